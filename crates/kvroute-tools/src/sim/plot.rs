//! The `--plot` chart of `kvroute replay`: TTFT distribution per policy
//! (percentile curves), prefix reuse against the infinite-cache ideal, and
//! load imbalance, side by side. It exists because a tail-latency curve is
//! easier to compare across policies than a table of percentiles. plotters draws it as SVG (no system fonts
//! or C libraries needed); for a `.png` path resvg rasterises that SVG with
//! whatever system fonts exist (without any, the chart renders without
//! its text).
//!
//! Compiled only with the `plot` feature (on by default): the server image is
//! built without it, so it carries no SVG rasteriser or font loading.

use std::path::Path;

use plotters::prelude::*;

use super::report::Report;

const PALETTE: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// Writes the comparison chart of `reports` to `path`: PNG when the path
/// ends in `.png`, SVG otherwise.
pub(crate) fn write_chart(path: &Path, reports: &[Report]) -> Result<(), String> {
    let mut svg = String::new();
    draw(&mut svg, reports)?;
    if path.extension().and_then(|e| e.to_str()) == Some("png") {
        let mut options = resvg::usvg::Options::default();
        let fonts = options.fontdb_mut();
        fonts.load_system_fonts();
        // "sans-serif" maps to Arial by default; use a sans face that exists.
        let sans = fonts
            .faces()
            .flat_map(|face| face.families.iter().map(|(name, _)| name.clone()))
            .find(|name| name.contains("Sans") && !name.contains("Mono"));
        if let Some(family) = sans {
            fonts.set_sans_serif_family(family);
        }
        let tree = resvg::usvg::Tree::from_str(&svg, &options).map_err(|e| e.to_string())?;
        let size = tree.size().to_int_size();
        let mut pixmap =
            resvg::tiny_skia::Pixmap::new(size.width(), size.height()).ok_or("empty chart")?;
        resvg::render(
            &tree,
            resvg::tiny_skia::Transform::default(),
            &mut pixmap.as_mut(),
        );
        pixmap.save_png(path).map_err(|e| e.to_string())
    } else {
        std::fs::write(path, svg).map_err(|e| e.to_string())
    }
}

fn draw(svg: &mut String, reports: &[Report]) -> Result<(), String> {
    let root = SVGBackend::with_string(svg, (1500, 500)).into_drawing_area();
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
    chart.configure_mesh().disable_x_mesh().x_labels(0).draw()?;
    for (i, report) in reports.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        let x = i as f64;
        chart.draw_series(std::iter::once(Rectangle::new(
            [(x + 0.15, 0.0), (x + 0.85, value(report))],
            color.filled(),
        )))?;
        // Each bar names its policy and value just above it.
        let label = format!("{} {:.3}", report.policy, value(report));
        chart.draw_series(std::iter::once(Text::new(
            label,
            (x + 0.1, value(report) + top * 0.04),
            ("sans-serif", 12).into_font(),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn report(policy: &str, reuse: f64) -> Report {
        Report {
            policy: policy.into(),
            reuse_ratio: reuse,
            ideal_reuse_ratio: 0.5,
            imbalance: 1.1,
            ttft_percentiles_ms: (0..=100).map(|p| f64::from(p) * 10.0).collect(),
            ttft_prediction: None,
            cached_prediction: None,
            ..Report::default()
        }
    }

    #[test]
    fn charts_are_written_as_svg_or_png() {
        let dir = std::env::temp_dir().join(format!("kvroute-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let reports = [report("kvroute", 0.3), report("round-robin", 0.1)];
        let svg = dir.join("chart.svg");
        write_chart(&svg, &reports).unwrap();
        let text = std::fs::read_to_string(&svg).unwrap();
        assert!(text.starts_with("<svg"));
        assert!(text.contains("kvroute 0.300") && text.contains("round-robin"));
        let png = dir.join("chart.png");
        write_chart(&png, &reports).unwrap();
        let bytes = std::fs::read(&png).unwrap();
        assert_eq!(&bytes[..4], b"\x89PNG");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
