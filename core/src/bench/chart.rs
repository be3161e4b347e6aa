//! The PNG chart of an `ft bench` matrix, drawn with plotters: tokens/s per
//! GPU (top) and peak allocated memory per GPU (bottom), one bar per
//! configuration. Text needs a TrueType font: `FT_CHART_FONT`, else DejaVu
//! Sans where Debian (fonts-dejavu-core) or matplotlib puts it.

use crate::bench::Row;
use anyhow::{anyhow, bail, Context, Result};
use plotters::prelude::*;
use std::path::{Path, PathBuf};

const FONT_PLACES: [&str; 3] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];

fn find_font() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("FT_CHART_FONT") {
        return Ok(PathBuf::from(path));
    }
    FONT_PLACES
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .ok_or_else(|| anyhow!("no TrueType font for the chart's text: install fonts-dejavu-core or set FT_CHART_FONT=path/to/font.ttf"))
}

/// Registers the font once per process (plotters keeps a 'static reference).
fn register_font() -> Result<()> {
    static REGISTERED: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    REGISTERED
        .get_or_init(|| {
            let path = find_font().map_err(|e| e.to_string())?;
            let bytes = std::fs::read(&path).map_err(|e| format!("cannot read font {}: {e}", path.display()))?;
            plotters::style::register_font("sans-serif", FontStyle::Normal, Box::leak(bytes.into_boxed_slice()))
                .map_err(|_| format!("{} is not a usable TrueType font", path.display()))
        })
        .clone()
        .map_err(|e| anyhow!(e))
}

fn label(row: &Row, several_models: bool) -> String {
    let mut text = format!("{} x{}", row.strategy, row.gpus);
    if row.offload != "none" {
        text += &format!(" +{}", row.offload);
    }
    if several_models {
        text = format!("{} {text}", row.model);
    }
    text
}

/// Draws `rows` (failed ones left out) into a PNG at `path`.
pub fn write(rows: &[Row], path: &Path) -> Result<()> {
    let rows: Vec<&Row> = rows.iter().filter(|r| r.error.is_none()).collect();
    if rows.is_empty() {
        bail!("no successful configuration to chart");
    }
    register_font()?;
    let several_models = rows.iter().any(|r| r.model != rows[0].model);
    let labels: Vec<String> = rows.iter().map(|r| label(r, several_models)).collect();
    let width = (160 * rows.len() as u32).clamp(640, 2400);
    let root = BitMapBackend::new(path, (width, 760)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("chart: {e}"))?;
    let (top, bottom) = root.split_vertically(380);
    let tokens: fn(&Row) -> f64 = |r| r.tokens_per_s_per_gpu;
    let memory: fn(&Row) -> f64 = |r| r.peak_allocated_gb;
    for (area, title, value) in [(&top, "tokens/s per GPU", tokens), (&bottom, "peak allocated GB per GPU", memory)] {
        let highest = rows.iter().map(|r| value(r)).fold(0.0, f64::max) * 1.15;
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 22))
            .margin(10)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d((0..rows.len().saturating_sub(1).max(1)).into_segmented(), 0.0..highest.max(1e-9))
            .map_err(|e| anyhow!("chart: {e}"))?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_label_formatter(&|x| match x {
                SegmentValue::CenterOf(i) => labels.get(*i).cloned().unwrap_or_default(),
                _ => String::new(),
            })
            .label_style(("sans-serif", 14))
            .draw()
            .map_err(|e| anyhow!("chart: {e}"))?;
        chart
            .draw_series(rows.iter().enumerate().map(|(i, r)| {
                let color = Palette99::pick(i).filled();
                Rectangle::new([(SegmentValue::Exact(i), 0.0), (SegmentValue::Exact(i + 1), value(r))], color)
            }))
            .map_err(|e| anyhow!("chart: {e}"))?;
    }
    root.present().with_context(|| format!("cannot write chart {}", path.display()))?;
    Ok(())
}
