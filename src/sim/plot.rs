//! The `--plot` chart of `kvroute replay`: TTFT distribution per policy
//! (percentile curves), prefix reuse against the infinite-cache ideal, and
//! load imbalance, side by side in one SVG (plotters' SVG backend needs no
//! system fonts or C libraries).

use std::path::Path;

use plotters::prelude::*;

use super::Report;

const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// Writes the comparison chart of `reports` to `path` as SVG.
pub fn write_svg(path: &Path, reports: &[Report]) -> Result<(), String> {
    let root = SVGBackend::new(path, (1500, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let panels = root.split_evenly((1, 3));
    ttft_panel(&panels[0], reports).map_err(|e| e.to_string())?;
    bar_panel(
        &panels[1],
        reports,
        "prefix reuse (dashed: ideal)",
        |r| r.reuse_ratio,
        reports.first().map(|r| r.ideal_reuse_ratio),
    )
    .map_err(|e| e.to_string())?;
    bar_panel(
        &panels[2],
        reports,
        "imbalance (max/mean prefill)",
        |r| r.imbalance,
        None,
    )
    .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}

type Area<'a> = DrawingArea<SVGBackend<'a>, plotters::coord::Shift>;
type DrawResult = Result<(), DrawingAreaErrorKind<std::io::Error>>;

fn ttft_panel(area: &Area<'_>, reports: &[Report]) -> DrawResult {
    let max_ms = reports
        .iter()
        .filter_map(|r| r.ttft_percentiles_ms.get(99).copied())
        .fold(1.0_f64, f64::max);
    let mut chart = ChartBuilder::on(area)
        .caption("TTFT by percentile (ms)", ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(55)
        .build_cartesian_2d(0f64..99f64, 0f64..max_ms * 1.05)?;
    chart
        .configure_mesh()
        .x_desc("percentile")
        .y_desc("ms")
        .draw()?;
    for (i, report) in reports.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let points = report
            .ttft_percentiles_ms
            .iter()
            .take(100)
            .enumerate()
            .map(|(p, v)| (p as f64, *v));
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))?
            .label(report.policy.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
}

fn bar_panel(
    area: &Area<'_>,
    reports: &[Report],
    title: &str,
    value: impl Fn(&Report) -> f64,
    reference: Option<f64>,
) -> DrawResult {
    let top = reports
        .iter()
        .map(&value)
        .chain(reference)
        .fold(0.0_f64, f64::max)
        .max(1e-9)
        * 1.15;
    let n = reports.len().max(1);
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(55)
        .build_cartesian_2d(0f64..n as f64, 0f64..top)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n)
        .x_label_formatter(&|x| {
            reports
                .get(x.floor() as usize)
                .map(|r| r.policy.clone())
                .unwrap_or_default()
        })
        .draw()?;
    for (i, report) in reports.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let x = i as f64;
        chart.draw_series(std::iter::once(Rectangle::new(
            [(x + 0.15, 0.0), (x + 0.85, value(report))],
            color.filled(),
        )))?;
    }
    if let Some(line) = reference {
        chart.draw_series(DashedLineSeries::new(
            [(0.0, line), (n as f64, line)],
            6,
            4,
            BLACK.stroke_width(2),
        ))?;
    }
    Ok(())
}
