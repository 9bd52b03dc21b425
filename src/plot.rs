//! Pictures of an audit ([`crate::core::audit`]) as one SVG of two panels:
//!
//! - above, the context tokens after every event of the conversation (by
//!   event number), with the budget, threshold and target lines, a filled
//!   triangle where each compaction job was issued and a filled circle at
//!   each provider context overflow;
//! - below, the summary DAG over the turn axis: one bar a summary spanning
//!   the raw turns it covers, leaves on the bottom row and each depth of
//!   condensed summaries a row above, a line from each condensed summary to
//!   its children, the raw turns in context as a strip under the leaves.
//!   Summaries no longer in context are pale; fallbacks are orange.
//!
//! Bars and marks are sized by the turn and event axes, not by count, so a
//! 1,000-turn session stays legible (a leaf of 20 turns is 25 px wide on
//! the default 1,400 px canvas); labels are drawn only on bars wide enough
//! to hold them, dark on pale and orange bars, white on dark ones. The
//! marks' fill colours are used by nothing else, so a reader (or a test)
//! can count them.
//!
//! The y-axis is scaled by [`chart_top`]: to the budgets in force and the
//! context, not to a `policy_recorded` event's, which carries whatever
//! policy the reader was configured with before the log's own is folded.

use crate::core::audit::{Audit, Dag};
use crate::core::event::{EventKind, SummaryKind};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::RGBColor;
use std::collections::HashMap;

/// Fill of the compaction marks (one a compaction job), `#8e24aa`.
pub const COMPACTION_FILL: &str = "#8E24AA";
/// Fill of the overflow marks (one a provider overflow), `#d50000`.
pub const OVERFLOW_FILL: &str = "#D50000";

const COMPACTION: RGBColor = RGBColor(0x8e, 0x24, 0xaa);
const OVERFLOW: RGBColor = RGBColor(0xd5, 0x00, 0x00);
const CONTEXT: RGBColor = RGBColor(0x1f, 0x77, 0xb4);
const BUDGET: RGBColor = RGBColor(0x33, 0x33, 0x33);
const THRESHOLD: RGBColor = RGBColor(0xff, 0x7f, 0x0e);
const TARGET: RGBColor = RGBColor(0x2c, 0xa0, 0x2c);
const LEAF: RGBColor = RGBColor(0x2e, 0x7d, 0x32);
const CONDENSED: RGBColor = RGBColor(0x39, 0x49, 0xab);
const FALLBACK: RGBColor = RGBColor(0xef, 0x6c, 0x00);
const RAW: RGBColor = RGBColor(0x78, 0x90, 0x9c);

/// The colour of a label on a bar of `fill`: of white and dark text, the
/// one of higher contrast (WCAG's relative luminance); dark on pale bars.
pub fn label_color(fill: RGBColor, in_context: bool) -> RGBColor {
    if !in_context {
        // Pale bars (30% of the colour on white).
        return LABEL_DARK;
    }
    fn luminance(RGBColor(r, g, b): RGBColor) -> f64 {
        let lin = |c: u8| {
            let c = f64::from(c) / 255.0;
            if c <= 0.03928 {
                c / 12.92
            } else {
                ((c + 0.055) / 1.055).powf(2.4)
            }
        };
        0.2126 * lin(r) + 0.7152 * lin(g) + 0.0722 * lin(b)
    }
    let bar = luminance(fill) + 0.05;
    let on_white = 1.05 / bar;
    let on_dark = bar / (luminance(LABEL_DARK) + 0.05);
    if on_white >= on_dark {
        WHITE
    } else {
        LABEL_DARK
    }
}

const LABEL_DARK: RGBColor = RGBColor(0x21, 0x21, 0x21);

/// Whether a point's levels (budget, threshold, target) are the
/// conversation's: a `policy_recorded` event's are those of whoever folded
/// it before the log's policy applied.
/// The audit page reads it from the server too (`sets_scale`).
pub fn sets_scale(p: &crate::core::audit::Point) -> bool {
    p.event_type != EventKind::PolicyRecorded
}

/// The top of the timeline's y-axis: the largest context and the largest
/// budget in force (not a `policy_recorded` point's), with 8% above.
pub fn chart_top(audit: &Audit) -> u64 {
    let budget = audit
        .points
        .iter()
        .filter(|p| sets_scale(p))
        .map(|p| p.budget)
        .max()
        .unwrap_or(0);
    let context = audit
        .points
        .iter()
        .map(|p| p.context_tokens)
        .max()
        .unwrap_or(0);
    (budget.max(context).max(1) as f64 * 1.08).ceil() as u64
}

/// Which level of a point a line draws.
type Level = fn(&crate::core::audit::Point) -> u64;

/// Canvas size of [`svg`].
pub const WIDTH: u32 = 1400;
pub const HEIGHT: u32 = 1000;

/// Why a picture could not be drawn.
#[derive(Debug, thiserror::Error)]
#[error("drawing the SVG failed: {0}")]
pub struct PlotError(String);

fn err<E: std::fmt::Debug>(e: E) -> PlotError {
    PlotError(format!("{e:?}"))
}

/// The timeline above the DAG, as one SVG document.
pub fn svg(audit: &Audit, dag: &Dag) -> Result<String, PlotError> {
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let (top, bottom) = root.split_vertically(HEIGHT / 2);
        timeline(audit, &top)?;
        summary_dag(&audit.conversation, dag, &bottom)?;
        root.present().map_err(err)?;
    }
    Ok(out)
}

/// The timeline alone (what the audit page draws above its DAG).
pub fn timeline_svg(audit: &Audit) -> Result<String, PlotError> {
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (WIDTH, HEIGHT / 2)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        timeline(audit, &root)?;
        root.present().map_err(err)?;
    }
    Ok(out)
}

fn timeline<DB: DrawingBackend>(
    audit: &Audit,
    area: &DrawingArea<DB, Shift>,
) -> Result<(), PlotError>
where
    DB::ErrorType: 'static,
{
    let points = &audit.points;
    let n = points.len().max(1) as f64;
    let ymax = chart_top(audit) as f64;
    let t = &audit.totals;
    let mut chart = ChartBuilder::on(area)
        .caption(
            format!(
                "{}: context tokens after each of {} events ({} compactions, {} overflows)",
                audit.conversation, t.events, t.compactions, t.overflows
            ),
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(72)
        .build_cartesian_2d(0f64..n, 0f64..ymax)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("event #")
        .y_desc("context tokens")
        .light_line_style(WHITE.mix(0.0))
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()
        .map_err(err)?;
    let line = |f: Level| {
        points
            .iter()
            .filter(|p| sets_scale(p))
            .map(move |p| (p.index as f64, f(p) as f64))
            .collect::<Vec<_>>()
    };
    let levels: [(&str, RGBColor, Level); 3] = [
        ("budget", BUDGET, |p| p.budget),
        ("threshold", THRESHOLD, |p| p.threshold_tokens),
        ("target", TARGET, |p| p.target_tokens),
    ];
    for (name, color, f) in levels {
        chart
            .draw_series(DashedLineSeries::new(line(f), 6, 4, color.stroke_width(1)))
            .map_err(err)?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart
        .draw_series(LineSeries::new(
            points
                .iter()
                .map(|p| (p.index as f64, p.context_tokens as f64)),
            CONTEXT.stroke_width(2),
        ))
        .map_err(err)?
        .label("context")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], CONTEXT.stroke_width(2)));
    chart
        .draw_series(
            points
                .iter()
                .filter(|p| p.mark == Some("compaction"))
                .map(|p| {
                    TriangleMarker::new(
                        (p.index as f64, p.context_tokens as f64),
                        7,
                        COMPACTION.filled(),
                    )
                }),
        )
        .map_err(err)?
        .label("compaction issued")
        .legend(|(x, y)| {
            // An outline, so the only filled triangles are the marks.
            PathElement::new(
                vec![
                    (x + 4, y + 5),
                    (x + 16, y + 5),
                    (x + 10, y - 5),
                    (x + 4, y + 5),
                ],
                COMPACTION.stroke_width(2),
            )
        });
    chart
        .draw_series(
            points
                .iter()
                .filter(|p| p.mark == Some("overflow"))
                .map(|p| {
                    Circle::new(
                        (p.index as f64, p.context_tokens as f64),
                        6,
                        OVERFLOW.filled(),
                    )
                }),
        )
        .map_err(err)?
        .label("provider overflow")
        .legend(|(x, y)| Circle::new((x + 10, y), 5, OVERFLOW.stroke_width(2)));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    Ok(())
}

/// A summary bar's colour: orange for a fallback, green for a leaf, indigo
/// for a condensed summary.
fn fill_of(n: &crate::core::audit::DagNode) -> RGBColor {
    if n.fallback {
        FALLBACK
    } else if n.kind == SummaryKind::Leaf {
        LEAF
    } else {
        CONDENSED
    }
}

fn summary_dag<DB: DrawingBackend>(
    conversation: &str,
    dag: &Dag,
    area: &DrawingArea<DB, Shift>,
) -> Result<(), PlotError>
where
    DB::ErrorType: 'static,
{
    let turns = dag.turns.max(1) as f64;
    let depth = dag.nodes.iter().map(|n| n.depth).max().unwrap_or(0) as f64;
    let mut chart = ChartBuilder::on(area)
        .caption(
            format!(
                "{conversation}: summary DAG over {} turns ({} summaries; pale: out of context, \
                 orange: fallback)",
                dag.turns,
                dag.nodes.len()
            ),
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(72)
        .build_cartesian_2d(0f64..turns, -1f64..depth + 1.0)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("turn")
        .y_desc("depth")
        .disable_y_mesh()
        .light_line_style(WHITE.mix(0.0))
        .y_labels((depth as usize + 3).min(12))
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| {
            if *y < -0.5 {
                "raw".to_string()
            } else if y.fract().abs() < 1e-9 && *y >= 0.0 {
                format!("{y:.0}")
            } else {
                String::new()
            }
        })
        .draw()
        .map_err(err)?;
    // Row `d` spans d-0.3..d+0.3; edges join a parent's bottom to a child's top.
    let center = |first: u64, last: u64| (first as f64 + last as f64 + 1.0) / 2.0;
    let by_id: HashMap<&str, (f64, u32)> = dag
        .nodes
        .iter()
        .map(|n| (n.id.as_str(), (center(n.first_turn, n.last_turn), n.depth)))
        .collect();
    let mut edges = Vec::new();
    for n in &dag.nodes {
        for child in &n.children {
            if let Some(&(cx, cd)) = by_id.get(child.as_str()) {
                let px = center(n.first_turn, n.last_turn);
                edges.push(PathElement::new(
                    vec![(px, n.depth as f64 - 0.3), (cx, cd as f64 + 0.3)],
                    BLACK.mix(if n.in_context { 0.5 } else { 0.15 }),
                ));
            }
        }
    }
    chart.draw_series(edges).map_err(err)?;
    chart
        .draw_series(dag.raw_in_context.iter().map(|[a, b]| {
            Rectangle::new([(*a as f64, -0.8), (*b as f64 + 1.0, -0.4)], RAW.filled())
        }))
        .map_err(err)?;
    chart
        .draw_series(dag.nodes.iter().map(|n| {
            let base = fill_of(n);
            let style = if n.in_context {
                base.filled()
            } else {
                base.mix(0.3).filled()
            };
            let d = n.depth as f64;
            Rectangle::new(
                [
                    (n.first_turn as f64, d - 0.3),
                    (n.last_turn as f64 + 1.0, d + 0.3),
                ],
                style,
            )
        }))
        .map_err(err)?;
    // Outlines keep adjacent bars apart.
    chart
        .draw_series(dag.nodes.iter().map(|n| {
            let d = n.depth as f64;
            Rectangle::new(
                [
                    (n.first_turn as f64, d - 0.3),
                    (n.last_turn as f64 + 1.0, d + 0.3),
                ],
                WHITE.stroke_width(1),
            )
        }))
        .map_err(err)?;
    // Turn ranges on bars wide enough to hold them.
    let px_per_turn = f64::from(WIDTH.saturating_sub(100)) / turns;
    chart
        .draw_series(dag.nodes.iter().filter_map(|n| {
            let label = format!("{}-{}", n.first_turn, n.last_turn);
            let width = (n.last_turn - n.first_turn + 1) as f64 * px_per_turn;
            let color = label_color(fill_of(n), n.in_context);
            (width >= label.len() as f64 * 7.0 + 6.0).then(|| {
                Text::new(
                    label,
                    (n.first_turn as f64 + 0.2, n.depth as f64 + 0.12),
                    ("sans-serif", 11).into_font().color(&color),
                )
            })
        }))
        .map_err(err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::audit::{Point, Totals};

    fn point(index: usize, event_type: EventKind, context: u64, budget: u64) -> Point {
        Point {
            index,
            position: index as u64 + 1,
            event_id: format!("e{index}"),
            event_type,
            time: 0,
            context_tokens: context,
            budget,
            threshold_tokens: budget * 3 / 4,
            target_tokens: budget / 2,
            mark: None,
        }
    }

    fn audit(points: Vec<Point>) -> Audit {
        Audit {
            conversation: "c".into(),
            totals: Totals::default(),
            entries: Vec::new(),
            compactions: Vec::new(),
            fallbacks: Vec::new(),
            points,
        }
    }

    #[test]
    fn the_chart_is_scaled_to_the_budget_in_force_not_to_a_policy_event() {
        // Policy events folded under the reader's default window (128k)
        // before the log's own policy (32k) applied.
        let a = audit(vec![
            point(0, EventKind::PolicyRecorded, 0, 128_000),
            point(1, EventKind::PolicyRecorded, 0, 128_000),
            point(2, EventKind::TurnAppended, 900, 32_000),
            point(3, EventKind::TurnAppended, 25_000, 32_000),
        ]);
        assert_eq!(chart_top(&a), 34_560);
        // Context over the budget raises the top with it.
        let a = audit(vec![point(0, EventKind::TurnAppended, 40_000, 32_000)]);
        assert_eq!(chart_top(&a), 43_200);
        assert_eq!(chart_top(&audit(Vec::new())), 2);
    }

    #[test]
    fn bar_labels_are_dark_on_pale_and_orange_bars_and_white_on_dark_ones() {
        assert_eq!(label_color(CONDENSED, true), WHITE);
        assert_eq!(label_color(LEAF, true), WHITE);
        assert_eq!(label_color(FALLBACK, true), LABEL_DARK);
        assert_eq!(label_color(CONDENSED, false), LABEL_DARK);
        assert_eq!(label_color(LEAF, false), LABEL_DARK);
    }
}
