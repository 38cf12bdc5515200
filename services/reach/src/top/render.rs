//! Drawing a [`Snapshot`] with ratatui; independent of where the data came from.

use std::time::Duration;

use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Borders, Paragraph, Row, Table};

use super::model::{Snapshot, TaskSummary};

/// Draws one frame of the live board (its header says how to quit).
pub fn render(frame: &mut Frame<'_>, snapshot: &Snapshot) {
    draw(frame, snapshot, true);
}

/// Draws one frame of the board; `live` adds the "(q to quit)" hint to the header.
pub fn draw(frame: &mut Frame<'_>, snapshot: &Snapshot, live: bool) {
    // The instances panel gets the rows its table needs; the middle panels take the rest. (Two
    // `Min` constraints split spare rows in the solver's own way, which cut the instances
    // table short by one row in a frame of exactly `content_height`.)
    let [header, instances, middle, failures] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(table_height(snapshot.instances.len())),
        Constraint::Min(5),
        Constraint::Length(failures_height(snapshot)),
    ])
    .areas(frame.area());
    let [traffic, tasks] =
        Layout::horizontal([Constraint::Percentage(65), Constraint::Percentage(35)]).areas(middle);
    render_header(frame, header, snapshot, live);
    render_instances(frame, instances, snapshot);
    render_traffic(frame, traffic, snapshot);
    render_tasks(frame, tasks, snapshot);
    render_failures(frame, failures, snapshot);
}

/// The height of a bordered table (or panel) of `n` rows with a header: at least 5.
fn table_height(n: usize) -> u16 {
    u16::try_from(n)
        .unwrap_or(u16::MAX)
        .saturating_add(3)
        .max(5)
}

fn failures_height(snapshot: &Snapshot) -> u16 {
    // Borders and header, plus up to 10 rows.
    3 + u16::try_from(snapshot.failures.len().clamp(1, 10)).unwrap_or(10)
}

/// The number of rows a frame needs to show all of `snapshot` (for printing one frame).
pub fn content_height(snapshot: &Snapshot) -> u16 {
    let rows = table_height;
    let task_lines = snapshot
        .tasks
        .as_ref()
        .map_or(1, |t| other_statuses(t).count() + 2);
    1u16.saturating_add(rows(snapshot.instances.len()))
        .saturating_add(rows(snapshot.capabilities.len()).max(rows(task_lines.saturating_sub(1))))
        .saturating_add(failures_height(snapshot))
}

fn bold() -> Style {
    Style::default().add_modifier(Modifier::BOLD)
}

fn render_header(frame: &mut Frame<'_>, area: Rect, snapshot: &Snapshot, live: bool) {
    let mut text = format!(
        "reach top — {}  instances {}  capabilities {} ({} with traffic)",
        snapshot.endpoint,
        snapshot.instances.len(),
        snapshot.registered_capabilities.len(),
        snapshot.capabilities.len()
    );
    if let Some(e) = &snapshot.registry_error {
        text.push_str(&format!("  | registry: {e}"));
    }
    if let Some(e) = &snapshot.metrics_error {
        text.push_str(&format!("  | metrics: {e}"));
    }
    if live {
        text.push_str("  (q to quit)");
    }
    frame.render_widget(Paragraph::new(Line::styled(text, bold())), area);
}

fn latency(d: Option<Duration>) -> String {
    match d {
        None => "-".to_string(),
        Some(d) if d < Duration::from_millis(1) => format!("{}µs", d.as_micros()),
        Some(d) if d < Duration::from_secs(1) => format!("{:.1}ms", d.as_secs_f64() * 1e3),
        Some(d) => format!("{:.2}s", d.as_secs_f64()),
    }
}

/// `text` cut to `width` characters by taking out its middle (`executor.ser…ing-2`), so names
/// that share a prefix or a suffix stay told apart; unchanged when it fits.
fn fit(text: &str, width: u16) -> String {
    let width = usize::from(width);
    let count = text.chars().count();
    if count <= width || width == 0 {
        return text.to_string();
    }
    if width == 1 {
        return "…".to_string();
    }
    let tail = (width - 1) / 2;
    let head = width - 1 - tail;
    let mut out: String = text.chars().take(head).collect();
    out.push('…');
    out.extend(text.chars().skip(count - tail));
    out
}

/// The widths ratatui gives the columns of a bordered table in `area` (default spacing 1).
fn column_widths(area: Rect, constraints: &[Constraint]) -> Vec<u16> {
    let inner = Block::default().borders(Borders::ALL).inner(area);
    Layout::horizontal(constraints.iter().copied())
        .spacing(1)
        .split(inner)
        .iter()
        .map(|r| r.width)
        .collect()
}

fn render_instances(frame: &mut Frame<'_>, area: Rect, snapshot: &Snapshot) {
    let constraints = [
        Constraint::Percentage(28),
        Constraint::Percentage(32),
        Constraint::Length(11),
        Constraint::Length(9),
        Constraint::Length(10),
    ];
    let widths = column_widths(area, &constraints);
    // Borders and the header take three rows; say so when instances do not fit.
    let room = usize::from(area.height.saturating_sub(3));
    let total = snapshot.instances.len();
    let title = if total > room {
        format!(" instances ({room} of {total} shown: make the terminal taller) ")
    } else {
        " instances ".to_string()
    };
    let rows = snapshot.instances.iter().map(|i| {
        let load = if i.max_concurrency == 0 {
            format!("{}/∞", i.in_flight)
        } else {
            format!("{}/{}", i.in_flight, i.max_concurrency)
        };
        Row::new(vec![
            fit(&i.service, widths[0]),
            fit(&i.instance_id, widths[1]),
            i.state.clone(),
            load,
            latency(i.p99),
        ])
    });
    let table = Table::new(rows, constraints)
        .header(Row::new(vec!["SERVICE", "INSTANCE", "STATE", "LOAD", "P99"]).style(bold()))
        .block(Block::default().borders(Borders::ALL).title(title));
    frame.render_widget(table, area);
}

fn render_traffic(frame: &mut Frame<'_>, area: Rect, snapshot: &Snapshot) {
    let constraints = [
        Constraint::Min(12),
        Constraint::Length(9),
        Constraint::Length(7),
        Constraint::Length(7),
        Constraint::Length(6),
        Constraint::Length(9),
    ];
    let widths = column_widths(area, &constraints);
    let room = usize::from(area.height.saturating_sub(3));
    let total = snapshot.capabilities.len();
    let title = if total > room {
        format!(" traffic ({room} of {total} shown) ")
    } else {
        " traffic ".to_string()
    };
    let rows = snapshot.capabilities.iter().map(|c| {
        Row::new(vec![
            fit(&c.capability, widths[0]),
            format!("{}", c.requests),
            c.rate
                .map_or_else(|| "-".to_string(), |r| format!("{r:.1}")),
            format!("{}", c.errors),
            format!("{}", c.in_flight),
            latency(c.p99),
        ])
    });
    let table = Table::new(rows, constraints)
        .header(
            Row::new(vec![
                "CAPABILITY",
                "REQUESTS",
                "REQ/S",
                "ERRORS",
                "LIVE",
                "P99",
            ])
            .style(bold()),
        )
        .block(Block::default().borders(Borders::ALL).title(title));
    frame.render_widget(table, area);
}

fn render_tasks(frame: &mut Frame<'_>, area: Rect, snapshot: &Snapshot) {
    let lines: Vec<Line<'_>> = match &snapshot.tasks {
        None => vec![Line::from("no orchestrator metrics")],
        Some(tasks) => {
            let mut lines = vec![Line::styled(
                format!("waiting for a person: {}", tasks.waiting_human),
                bold(),
            )];
            lines.extend(
                other_statuses(tasks)
                    .map(|(status, count)| Line::from(format!("{status:<14} {count}"))),
            );
            lines.push(Line::from(format!("dead letters   {}", tasks.dead_letters)));
            lines
        }
    };
    frame.render_widget(
        Paragraph::new(lines).block(Block::default().borders(Borders::ALL).title(" tasks ")),
        area,
    );
}

/// Task counts by status, without `waiting_human`, which has its own line.
fn other_statuses(tasks: &TaskSummary) -> impl Iterator<Item = (&String, &f64)> {
    tasks
        .by_status
        .iter()
        .filter(|(status, _)| status.as_str() != "waiting_human")
}

fn render_failures(frame: &mut Frame<'_>, area: Rect, snapshot: &Snapshot) {
    let rows = snapshot.failures.iter().map(|f| {
        Row::new(vec![
            f.message_type.clone(),
            format!("{}", f.count),
            f.last_error.clone(),
        ])
    });
    let table = Table::new(
        rows,
        [
            Constraint::Percentage(40),
            Constraint::Length(9),
            Constraint::Min(10),
        ],
    )
    .header(Row::new(vec!["MESSAGE TYPE", "FAILURES", "LAST ERROR"]).style(bold()))
    .block(
        Block::default()
            .borders(Borders::ALL)
            .title(" failing message types "),
    );
    frame.render_widget(table, area);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fitting_keeps_both_ends() {
        assert_eq!(fit("executor.servicing-2", 30), "executor.servicing-2");
        assert_eq!(fit("executor.servicing-2", 11), "execu…ing-2");
        assert_eq!(fit("executor.servicing-2", 11).chars().count(), 11);
        assert_ne!(
            fit("executor.servicing-1", 11),
            fit("executor.servicing-2", 11)
        );
        assert_eq!(fit("abc", 1), "…");
    }
}
