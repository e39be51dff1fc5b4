//! A text table: what every sub-command's default output is made of, so
//! all of them align their columns the same way.

/// A text table: a header row and rows, columns padded to their widest cell;
/// numeric columns are right-aligned.
pub(super) struct Table {
    headers: Vec<&'static str>,
    right: Vec<bool>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// Columns as (header, right-aligned).
    pub(super) fn new(columns: &[(&'static str, bool)]) -> Self {
        Self {
            headers: columns.iter().map(|c| c.0).collect(),
            right: columns.iter().map(|c| c.1).collect(),
            rows: Vec::new(),
        }
    }

    pub(super) fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub(super) fn render(&self) -> String {
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (width, cell) in widths.iter_mut().zip(row) {
                *width = (*width).max(cell.chars().count());
            }
        }
        let mut text = String::new();
        let header: Vec<String> = self.headers.iter().map(|h| h.to_string()).collect();
        for row in std::iter::once(&header).chain(&self.rows) {
            let mut line = String::new();
            for (i, cell) in row.iter().enumerate() {
                let width = widths.get(i).copied().unwrap_or(0);
                if i > 0 {
                    line.push_str("  ");
                }
                let pad = " ".repeat(width.saturating_sub(cell.chars().count()));
                if self.right.get(i).copied().unwrap_or(false) {
                    line.push_str(&pad);
                    line.push_str(cell);
                } else {
                    line.push_str(cell);
                    line.push_str(&pad);
                }
            }
            text.push_str(line.trim_end());
            text.push('\n');
        }
        text
    }

    /// The rows without the header row, which a key/value list leaves empty.
    pub(super) fn render_rows(&self) -> String {
        let text = self.render();
        text.split_once('\n')
            .map_or(String::new(), |(_, rest)| rest.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_columns() {
        let mut table = Table::new(&[("ID", true), ("NAME", false)]);
        table.row(vec!["7".into(), "a".into()]);
        table.row(vec!["123".into(), "long name".into()]);
        assert_eq!(table.render(), " ID  NAME\n  7  a\n123  long name\n");
    }
}
