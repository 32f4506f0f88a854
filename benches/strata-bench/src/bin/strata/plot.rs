//! `--plot FILE.svg`: horizontal bar charts, one panel per comparison, the
//! first bar (strata) highlighted.

use plotters::prelude::*;
use strata::Error;

/// One panel: a caption, the x axis's description, and (name, value) bars.
pub struct Panel<'a> {
    pub caption: String,
    pub x_desc: &'a str,
    pub bars: Vec<(&'a str, f64)>,
}

/// Draws the panels stacked into an SVG, written to `out` (checked before
/// the run) once drawn.
pub fn bars(out: &crate::out::OutputPath, panels: &[Panel<'_>]) -> Result<(), Error> {
    let mut svg = String::new();
    draw(&mut svg, panels)
        .map_err(|e| Error::invalid(format!("drawing {}: {e}", out.path().display())))?;
    out.write(svg.as_bytes())
}

fn draw(svg: &mut String, panels: &[Panel<'_>]) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| e.to_string();
    let root =
        SVGBackend::with_string(svg, (720, 300 * panels.len().max(1) as u32)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    for (p, area) in panels
        .iter()
        .zip(root.split_evenly((panels.len().max(1), 1)))
    {
        let max = p.bars.iter().map(|b| b.1).fold(0.0f64, f64::max) * 1.15;
        let mut chart = ChartBuilder::on(&area)
            .caption(&p.caption, ("sans-serif", 16))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(90)
            .build_cartesian_2d(0.0..max.max(1e-9), (0..p.bars.len()).into_segmented())
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc(p.x_desc)
            .y_label_formatter(&|y| match y {
                SegmentValue::CenterOf(i) => p.bars.get(*i).map_or("", |b| b.0).to_string(),
                _ => String::new(),
            })
            .draw()
            .map_err(|e| err(&e))?;
        chart
            .draw_series(p.bars.iter().enumerate().map(|(i, b)| {
                let color = if i == 0 {
                    BLUE
                } else {
                    RGBColor(150, 150, 150)
                };
                Rectangle::new(
                    [
                        (0.0, SegmentValue::Exact(i)),
                        (b.1, SegmentValue::Exact(i + 1)),
                    ],
                    color.filled(),
                )
            }))
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
