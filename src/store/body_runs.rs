//! Turn bodies stored in runs: the bodies one commit adds to a conversation,
//! consecutive by sequence, in records of about [`RUN_BYTES`] each, keyed by
//! the first sequence they hold.
//!
//! The store's cost is per record: a busy conversation commits hundreds of
//! turns at once, and one record per body made the body inserts most of a
//! commit's work. A run bounds what one body's read decodes (a record of
//! about [`RUN_BYTES`], or one larger body alone), and a reader finds the run
//! that holds a sequence with one seek ([`KvBackend::last_at_or_before`]).
//!
//! A run is written once, in the commit that first stores its turns (so
//! it never spans two commits and is never rewritten): the store's crash
//! reasoning is unchanged.
//!
//! A run's value is its bodies' encodings back to back, then the end offset
//! of each (`u32`, little-endian) and their count (`u32`). Nothing here is
//! trusted when read: an offset out of order or out of bounds is an error
//! that names it, never a panic.
//!
//! [`KvBackend::last_at_or_before`]: crate::store::KvBackend::last_at_or_before

use crate::core::state::TurnBody;

/// The most a run's value holds (its bodies and offsets), unless one body
/// alone is larger. Under 64 KiB with room for the key and the page's own
/// bookkeeping: redb allocates pages in powers of two, and a value just over
/// 64 KiB would take 128 (measured: `docs/notes/issue-26.md`, fourteenth
/// pass).
pub(crate) const RUN_BYTES: usize = 63 * 1024;

/// Splits consecutive `(sequence, body)` pairs into runs and hands each to
/// `emit` with its first sequence: a run ends before it would pass
/// [`RUN_BYTES`] or where a sequence is not the one after the last.
pub(crate) fn write_runs<'a>(
    bodies: impl IntoIterator<Item = (u64, &'a TurnBody)>,
    mut emit: impl FnMut(u64, Vec<u8>),
) {
    let mut run: Option<Run> = None;
    for (seq, body) in bodies {
        let mut open = match run.take() {
            Some(open) if open.next == seq => open,
            other => {
                if let Some(closed) = other {
                    emit(closed.first, closed.finish());
                }
                Run::starting_at(seq)
            }
        };
        let encoded_at = open.data.len();
        open.push(body);
        if open.size() > RUN_BYTES && open.ends.len() > 1 {
            // The body just written starts the next run.
            let next = Run::moved_from(&mut open, encoded_at);
            emit(open.first, open.finish());
            open = next;
        }
        run = Some(open);
    }
    if let Some(last) = run {
        emit(last.first, last.finish());
    }
}

/// A run being written.
struct Run {
    first: u64,
    next: u64,
    data: Vec<u8>,
    ends: Vec<u32>,
}

impl Run {
    fn starting_at(first: u64) -> Run {
        Run {
            first,
            next: first,
            data: Vec::with_capacity(4 * 1024),
            ends: Vec::new(),
        }
    }

    /// A run of `from`'s last body, encoded at `encoded_at`; `from` keeps
    /// the bodies before it.
    fn moved_from(from: &mut Run, encoded_at: usize) -> Run {
        let data = from.data[encoded_at..].to_vec();
        from.data.truncate(encoded_at);
        from.ends.pop();
        from.next -= 1;
        Run {
            first: from.next,
            next: from.next + 1,
            // Its end was a `u32` in `from`: its length is one too.
            ends: vec![data.len() as u32],
            data,
        }
    }

    /// The value's size once finished.
    fn size(&self) -> usize {
        self.data.len() + 4 * self.ends.len() + 4
    }

    #[allow(clippy::expect_used)] // only a bug reaches the expects (see their messages)
    fn push(&mut self, body: &TurnBody) {
        rmp_serde::encode::write_named(&mut self.data, body).expect("turn bodies serialize");
        self.ends
            .push(u32::try_from(self.data.len()).expect("a run is closed long before 4 GiB"));
        self.next += 1;
    }

    #[allow(clippy::expect_used)] // only a bug reaches the expect (see its message)
    fn finish(mut self) -> Vec<u8> {
        self.data.reserve(4 * self.ends.len() + 4);
        for end in &self.ends {
            self.data.extend_from_slice(&end.to_le_bytes());
        }
        let count = u32::try_from(self.ends.len()).expect("a run holds fewer than 2^32 bodies");
        self.data.extend_from_slice(&count.to_le_bytes());
        self.data
    }
}

/// Why a run's value could not be read.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RunError {
    #[error("a run of turn bodies of {len} bytes is too short for its table of {count} offsets")]
    Truncated { len: usize, count: u64 },
    #[error("offset {index} of a run of turn bodies ({end}) is before the one before it or past its data ({data} bytes)")]
    BadOffset { index: usize, end: u32, data: usize },
    #[error("turn body {index} of its run could not be decoded: {source}")]
    Undecodable {
        index: usize,
        #[source]
        source: rmp_serde::decode::Error,
    },
}

/// The encoded bodies of a run's value, in order.
pub(crate) fn encoded_bodies(value: &[u8]) -> Result<Vec<&[u8]>, RunError> {
    let count_at = value.len().checked_sub(4).ok_or(RunError::Truncated {
        len: value.len(),
        count: 0,
    })?;
    let mut count = [0u8; 4];
    count.copy_from_slice(&value[count_at..]);
    let count = u32::from_le_bytes(count) as usize;
    let table_at = count
        .checked_mul(4)
        .and_then(|table| count_at.checked_sub(table))
        .ok_or(RunError::Truncated {
            len: value.len(),
            count: count as u64,
        })?;
    let (data, table) = value[..count_at].split_at(table_at);
    let mut start = 0usize;
    let mut out = Vec::with_capacity(count);
    for (index, end) in table.chunks_exact(4).enumerate() {
        let end = u32::from_le_bytes([end[0], end[1], end[2], end[3]]);
        let body = data.get(start..end as usize).ok_or(RunError::BadOffset {
            index,
            end,
            data: data.len(),
        })?;
        out.push(body);
        start = end as usize;
    }
    Ok(out)
}

/// Decodes one body of a run (`index`: its place in the run).
pub(crate) fn decode_body(index: usize, bytes: &[u8]) -> Result<TurnBody, RunError> {
    rmp_serde::from_slice(bytes).map_err(|source| RunError::Undecodable { index, source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::event::TurnAppended;
    use crate::core::message::{ChatMessage, Role};

    fn body(i: u64, text_len: usize) -> TurnBody {
        TurnBody::new(
            &format!("e{i}"),
            TurnAppended {
                message: ChatMessage::text(Role::User, "x".repeat(text_len)),
                model: None,
                sender: None,
                usage: None,
                metadata: None,
            },
        )
    }

    fn decode_run(value: &[u8]) -> Result<Vec<TurnBody>, RunError> {
        encoded_bodies(value)?
            .into_iter()
            .enumerate()
            .map(|(index, bytes)| decode_body(index, bytes))
            .collect()
    }

    fn runs(bodies: &[(u64, TurnBody)]) -> Vec<(u64, Vec<u8>)> {
        let mut out = Vec::new();
        write_runs(bodies.iter().map(|(s, b)| (*s, b)), |first, value| {
            out.push((first, value))
        });
        out
    }

    #[test]
    fn bodies_come_back_from_their_runs_in_order() {
        let bodies: Vec<(u64, TurnBody)> = (10..60).map(|i| (i, body(i, 3_000))).collect();
        let written = runs(&bodies);
        // 50 bodies of ~3 KB: more than one run, each within RUN_BYTES.
        assert!(written.len() > 1, "{} runs", written.len());
        let mut back = Vec::new();
        let mut expected_first = 10;
        for (first, value) in &written {
            assert_eq!(*first, expected_first);
            assert!(value.len() <= RUN_BYTES, "a run of {} bytes", value.len());
            let decoded = decode_run(value).unwrap();
            expected_first += decoded.len() as u64;
            back.extend(decoded);
        }
        let want: Vec<TurnBody> = bodies.into_iter().map(|(_, b)| b).collect();
        assert_eq!(back, want);
    }

    #[test]
    fn a_gap_in_the_sequences_starts_a_new_run_and_a_large_body_stands_alone() {
        let bodies = vec![
            (0, body(0, 10)),
            (1, body(1, 10)),
            (5, body(5, 10)),
            (6, body(6, 2 * RUN_BYTES)),
            (7, body(7, 10)),
        ];
        let firsts: Vec<(u64, usize)> = runs(&bodies)
            .iter()
            .map(|(first, value)| (*first, decode_run(value).unwrap().len()))
            .collect();
        assert_eq!(firsts, vec![(0, 2), (5, 1), (6, 1), (7, 1)]);
        assert!(runs(&[]).is_empty());
    }

    #[test]
    fn a_damaged_run_is_an_error_not_a_panic() {
        let written = runs(&[(0, body(0, 100)), (1, body(1, 100))]);
        let value = &written[0].1;
        for cut in 0..value.len() {
            // Any prefix, and any single flipped byte, reads as an error or
            // as bodies (a flip inside a text), never a panic.
            let _ = decode_run(&value[..cut]);
            let mut flipped = value.clone();
            flipped[cut] ^= 0xa5;
            let _ = decode_run(&flipped);
        }
        assert!(matches!(
            encoded_bodies(&[1, 0, 0, 0]),
            Err(RunError::Truncated { count: 1, .. })
        ));
        let mut backwards = value[..value.len() - 12].to_vec();
        backwards.extend_from_slice(&5u32.to_le_bytes());
        backwards.extend_from_slice(&3u32.to_le_bytes());
        backwards.extend_from_slice(&2u32.to_le_bytes());
        assert!(matches!(
            encoded_bodies(&backwards),
            Err(RunError::BadOffset { index: 1, .. })
        ));
    }
}
