//! `loss.png`: the training loss of every step and the eval losses, drawn with plotters. Text
//! needs a font file: the first of a few common system fonts that exists (without one the
//! curves are drawn without labels; `loss.csv` has the numbers either way).

use std::path::Path;

use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

use hesper::train::StepRecord;

const FONTS: [&str; 4] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
    "C:\\Windows\\Fonts\\arial.ttf",
];

/// Whether a font could be registered (once per process).
fn font() -> bool {
    static FONT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FONT.get_or_init(|| {
        FONTS.iter().any(|path| {
            let Ok(bytes) = std::fs::read(path) else {
                return false;
            };
            // plotters keeps the font for the life of the process.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            register_font("sans-serif", FontStyle::Normal, bytes).is_ok()
        })
    })
}

/// Draw `history`'s losses into the PNG file `path` (written whole: a temporary file, then
/// renamed).
pub fn loss_png(path: &Path, history: &[StepRecord]) -> Result<(), String> {
    let fail = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let train: Vec<(f64, f64)> = history
        .iter()
        .filter(|r| r.loss.is_finite())
        .map(|r| (r.step as f64, r.loss as f64))
        .collect();
    let eval: Vec<(f64, f64)> = history
        .iter()
        .filter_map(|r| Some((r.step as f64, r.eval_loss?)))
        .collect();
    let values = train.iter().chain(&eval).map(|p| p.1);
    let (lo, hi) = values.fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if train.is_empty() {
        return Ok(());
    }
    let pad = ((hi - lo) * 0.05).max(1e-3);
    let last = history.last().map_or(1, |r| r.step).max(2) as f64;
    let tmp = path.with_extension("partial.png");
    {
        let root = BitMapBackend::new(&tmp, (800, 480)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| fail(&e))?;
        let text = font();
        let mut builder = ChartBuilder::on(&root);
        builder.margin(16);
        if text {
            builder
                .caption("loss", ("sans-serif", 22))
                .x_label_area_size(36)
                .y_label_area_size(56);
        }
        let mut chart = builder
            .build_cartesian_2d(1f64..last, (lo - pad)..(hi + pad))
            .map_err(|e| fail(&e))?;
        let mut mesh = chart.configure_mesh();
        if text {
            mesh.x_desc("step");
        } else {
            mesh.disable_x_mesh().disable_y_mesh();
        }
        mesh.draw().map_err(|e| fail(&e))?;
        let series = chart
            .draw_series(LineSeries::new(train, BLUE.stroke_width(2)))
            .map_err(|e| fail(&e))?;
        if text {
            series
                .label("train")
                .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], BLUE));
        }
        if !eval.is_empty() {
            let points = eval.iter().map(|&p| Circle::new(p, 4, RED.filled()));
            let series = chart.draw_series(points).map_err(|e| fail(&e))?;
            if text {
                series
                    .label("eval")
                    .legend(|(x, y)| Circle::new((x + 8, y), 4, RED.filled()));
            }
        }
        if text {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .draw()
                .map_err(|e| fail(&e))?;
        }
        root.present().map_err(|e| fail(&e))?;
    }
    std::fs::rename(&tmp, path).map_err(|e| fail(&e))
}
