//! SVG plots with plotters (SVG backend only: no system font libraries needed).

use std::path::Path;

use anyhow::anyhow;
use plotters::prelude::*;

/// One line of a panel: a name and `(x, y)` points.
#[derive(Debug, Clone)]
pub(crate) struct Series {
    pub(crate) name: String,
    pub(crate) points: Vec<(f64, f64)>,
}

impl Series {
    pub(crate) fn new(name: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Self {
            name: name.into(),
            points,
        }
    }
}

/// One chart of a figure, stacked vertically with the others on a shared x axis.
#[derive(Debug, Clone)]
pub(crate) struct Panel {
    pub(crate) title: String,
    pub(crate) y_label: String,
    pub(crate) series: Vec<Series>,
}

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// Writes `panels` as one SVG, `x_label` under the last.
pub(crate) fn figure(path: &Path, x_label: &str, panels: &[Panel]) -> anyhow::Result<()> {
    let height = 260 * panels.len().max(1) as u32;
    let root = SVGBackend::new(path, (960, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    let areas = root.split_evenly((panels.len().max(1), 1));
    for (panel, area) in panels.iter().zip(areas.iter()) {
        let points = panel.series.iter().flat_map(|s| s.points.iter());
        let (mut x0, mut x1, mut y1) = (f64::MAX, f64::MIN, 0.0f64);
        for &(x, y) in points {
            x0 = x0.min(x);
            x1 = x1.max(x);
            y1 = y1.max(y);
        }
        if x0 > x1 {
            (x0, x1) = (0.0, 1.0);
        }
        if x1 <= x0 {
            x1 = x0 + 1.0;
        }
        let y1 = if y1 <= 0.0 { 1.0 } else { y1 * 1.1 };
        let mut chart = ChartBuilder::on(area)
            .caption(&panel.title, ("sans-serif", 16))
            .margin(8)
            .x_label_area_size(30)
            .y_label_area_size(70)
            .build_cartesian_2d(x0..x1, 0.0..y1)
            .map_err(|e| anyhow!("{e}"))?;
        chart
            .configure_mesh()
            .x_desc(x_label)
            .y_desc(&panel.y_label)
            .draw()
            .map_err(|e| anyhow!("{e}"))?;
        for (i, series) in panel.series.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            chart
                .draw_series(LineSeries::new(
                    series.points.iter().copied(),
                    color.stroke_width(2),
                ))
                .map_err(|e| anyhow!("{e}"))?
                .label(series.name.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
        }
        if panel.series.len() > 1 {
            chart
                .configure_series_labels()
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .position(SeriesLabelPosition::UpperLeft)
                .draw()
                .map_err(|e| anyhow!("{e}"))?;
        }
    }
    root.present().map_err(|e| anyhow!("{e}"))?;
    Ok(())
}
