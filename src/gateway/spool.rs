//! Turns the gateway accepted while NATS could not take them.
//!
//! A file of JSON lines (one event each, in the order they were accepted)
//! under `[gateway] spool_dir`, rewritten whole (to a temporary file, then
//! renamed) whenever it changes, and read back when the gateway starts: a
//! turn accepted in fail-open mode survives a restart and is published
//! when NATS is back, under its own id, so publishing it twice changes
//! nothing. A crash between a publish and the rewrite leaves a turn in the
//! file that is already stored: republished, it is a duplicate the fold
//! drops.

use crate::core::event::Envelope;
use std::collections::VecDeque;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;

pub struct Spool {
    path: Option<PathBuf>,
    pending: Mutex<VecDeque<Envelope>>,
}

impl Spool {
    /// A spool kept in `dir` (created if needed), with what a previous run
    /// left there.
    pub fn open(dir: &std::path::Path) -> std::io::Result<Spool> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join("spool.jsonl");
        let mut pending = VecDeque::new();
        if let Ok(text) = std::fs::read_to_string(&path) {
            for line in text.lines().filter(|l| !l.trim().is_empty()) {
                match serde_json::from_str::<Envelope>(line) {
                    Ok(e) => pending.push_back(e),
                    Err(e) => crate::telemetry::GatewayStoreFailed {
                        error: &format!("unreadable spooled turn skipped: {e}"),
                    }
                    .emit(),
                }
            }
        }
        Ok(Spool {
            path: Some(path),
            pending: Mutex::new(pending),
        })
    }

    /// A spool in memory only (tests).
    pub fn in_memory() -> Spool {
        Spool {
            path: None,
            pending: Mutex::new(VecDeque::new()),
        }
    }

    pub fn len(&self) -> usize {
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The spooled turns, oldest first, left in place while they are
    /// published ([`Spool::drop_front`] removes those that were).
    pub fn snapshot(&self) -> Vec<Envelope> {
        let q = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        q.iter().cloned().collect()
    }

    /// Removes the `n` oldest turns (published), and writes the file.
    pub fn drop_front(&self, n: usize) {
        if n == 0 {
            return;
        }
        let mut q = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let n = n.min(q.len());
        q.drain(..n);
        crate::telemetry::GatewaySpooled { pending: q.len() }.emit();
        if let Some(path) = &self.path {
            if let Err(e) = write_all(path, &q) {
                crate::telemetry::GatewayStoreFailed {
                    error: &format!("writing the spool {}: {e}", path.display()),
                }
                .emit();
            }
        }
    }

    /// Takes every spooled turn (oldest first) to publish.
    pub fn take(&self) -> Vec<Envelope> {
        let mut q = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        q.drain(..).collect()
    }

    /// Adds turns after those waiting (NATS is away: they wait their turn,
    /// in order), and writes the file.
    pub fn append(&self, events: Vec<Envelope>) {
        let mut q = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        q.extend(events);
        crate::telemetry::GatewaySpooled { pending: q.len() }.emit();
        if let Some(path) = &self.path {
            if let Err(e) = write_all(path, &q) {
                crate::telemetry::GatewayStoreFailed {
                    error: &format!("writing the spool {}: {e}", path.display()),
                }
                .emit();
            }
        }
    }

    /// Puts turns that could not be published back at the head, and
    /// writes the file.
    pub fn put_back(&self, events: Vec<Envelope>) {
        let mut q = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        for e in events.into_iter().rev() {
            q.push_front(e);
        }
        crate::telemetry::GatewaySpooled { pending: q.len() }.emit();
        if let Some(path) = &self.path {
            if let Err(e) = write_all(path, &q) {
                crate::telemetry::GatewayStoreFailed {
                    error: &format!("writing the spool {}: {e}", path.display()),
                }
                .emit();
            }
        }
    }
}

fn write_all(path: &std::path::Path, q: &VecDeque<Envelope>) -> std::io::Result<()> {
    let tmp = path.with_extension("jsonl.tmp");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
    for e in q {
        writeln!(f, "{}", e.to_json())?;
    }
    f.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::event::{EventBody, TurnAppended};
    use crate::core::message::{ChatMessage, Role};

    #[test]
    fn spooled_turns_survive_a_restart_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let turn = |i: u32| {
            Envelope::new(
                format!("e{i}"),
                "c",
                1,
                EventBody::TurnAppended(TurnAppended::from(ChatMessage::text(
                    Role::User,
                    format!("t{i}"),
                ))),
            )
        };
        let spool = Spool::open(dir.path()).unwrap();
        spool.put_back(vec![turn(1), turn(2)]);
        drop(spool);
        let again = Spool::open(dir.path()).unwrap();
        let ids: Vec<String> = again.take().into_iter().map(|e| e.id).collect();
        assert_eq!(ids, ["e1", "e2"]);
    }
}
