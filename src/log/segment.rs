//! The embedded event log: append-only, checksummed, fsync'd segment files in
//! one directory on local disk.
//!
//! # On disk
//!
//! The directory holds a `LOCK` file (held with an exclusive OS lock while a
//! [`SegmentLog`] is open, so two processes never append to the same log;
//! released as soon as the log is dropped), a `HEAD` file (below) and
//! segment files named `{first position:020}.seg`. A segment is a sequence of
//! records, each
//!
//! ```text
//! magic "cfL1" | length u32 LE | crc32 u32 LE | kind u8 | payload (length bytes)
//! ```
//!
//! The kind byte names the payload's encoding and who wrote the record
//! (its [`Origin`]): 3 / 4 an agent's MessagePack / JSON, 5 / 6 the
//! service's. Logs written before origins were recorded hold 1 / 2
//! (MessagePack / JSON), read as [`Origin::Legacy`]. Any other value is
//! reported as written by a newer version.
//!
//! The CRC (crc32fast) covers the length field, the kind byte and the
//! payload, so a damaged length is caught as surely as a damaged payload.
//! Appends go to the newest segment; when a record would push it past
//! [`SegmentOptions::segment_bytes`] (256 MiB by default) a new segment is
//! started. Old segments are never rewritten or deleted by this module.
//!
//! `HEAD` says how far the newest segment was synced, as 40 bytes:
//!
//! ```text
//! magic "cfH1" | segment's first position u64 | records u64 | bytes u64
//!              | offset of the last of those records u64 | crc32 of the 36 before, u32 LE
//! ```
//!
//! It is rewritten in place after every sync of the newest segment (after
//! the `fdatasync` returned, never before) and when a new segment starts,
//! and is not synced itself. Logs without one (older builds) open as before
//! and get one at their first sync.
//!
//! # Crash safety
//!
//! [`SegmentLog::append_sync`] writes and `fdatasync`s before it returns;
//! [`SegmentLog::append_batch_sync`] syncs once per segment it touched
//! (normally once). A crash can therefore only leave damage after the last
//! synced byte of the newest segment: a torn tail.
//!
//! Opening a log costs the same whatever its history: it reads the file
//! names, `HEAD`, one record and the bytes appended after `HEAD` was last
//! written (none after a clean close). A sealed segment holds exactly the
//! records between its first position and the next segment's (both in the
//! file names); the newest one holds at least what `HEAD` says, since
//! `HEAD` is written only once those bytes are durable. A `HEAD` that
//! survives a crash, whichever version of it (a lost write leaves an older
//! one, still true: segments only grow, and every truncation below cuts at
//! or past the synced end), therefore only ever names synced bytes, and a
//! torn tail can only lie after them. On open `HEAD` is checked at the cost
//! of one record: it must name the newest segment, the file must be at
//! least that long, and the last record it names must be valid and end
//! exactly where it says. If any of that fails (or `HEAD` is missing, torn
//! or of another format) it is ignored, with a warning, and the newest
//! segment is scanned whole as older builds did. The records after what
//! `HEAD` vouches for are scanned and their checksums verified. A damaged
//! record there with no valid record anywhere after it is a torn tail: it
//! is truncated away, logged with `tracing::warn!`, and the number of
//! dropped bytes is reported by [`SegmentLog::dropped_tail_bytes`]; then
//! `HEAD` is rewritten (after the truncation's sync), so the next open does
//! not scan them again. A damaged record that is followed by a valid one,
//! or any damage in bytes a sealed segment's name or `HEAD` vouches for,
//! cannot come from a crash during an append; it is reported as
//! [`LogError::Corrupt`] naming the file and byte offset, and nothing is
//! truncated. What is taken on a name's or `HEAD`'s word is scanned and
//! verified the first time a read reaches its segment, and that read
//! reports the damage, as it does a segment whose records do not number
//! what the file names say (a segment missing) or a newest segment whose
//! vouched part does not hold what `HEAD` says.
//!
//! # Deferred appends
//!
//! [`SegmentLog::append_deferred`] promises a record durable only after the
//! next [`SegmentLog::sync_now`]. Until then it gathers the framed records
//! in memory (indexed and readable at once, from there) and writes them in
//! one positioned write once a mebibyte has gathered, at the sync, before
//! an append that syncs, before a new segment starts, when a read takes
//! both older records and these, and when the log is dropped. `run`
//! appends and reads back each record it folds: two system calls a record
//! became one write a mebibyte. A kill loses what was still in memory, a
//! suffix of the unsynced records, as a crash before the sync always could;
//! nothing that a sync vouched for moves. A write that fails drops the
//! records it carried from the log (and cuts the file where they began), so
//! the error reaches the caller at that append, read or sync, which must
//! not commit state that folded them: the embedded pipeline commits only
//! after a sync succeeds.
//!
//! Reads go through an in-memory index of record offsets (8 bytes per
//! record, built for a segment by the first read that reaches it), so
//! `read_after(pos, max)` costs O(max) whatever the log's size.
//! Checksums are verified again on every read.
//!
//! The file I/O is blocking: the log is a local file and each call is short.
//! The async [`EventLog`] methods call the `*_sync` ones directly.

use super::{Appended, EventLog, LogError, LogRecord, Position};
use crate::core::event::{Encoding, Origin};
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// The first four bytes of every record.
pub const RECORD_MAGIC: [u8; 4] = *b"cfL1";
/// Magic, length and checksum.
const HEADER_LEN: u64 = 12;
/// Header plus the kind byte: the size of a record with an empty payload.
pub const RECORD_OVERHEAD: u64 = HEADER_LEN + 1;
/// Default size at which a new segment is started.
pub const DEFAULT_SEGMENT_BYTES: u64 = 256 * 1024 * 1024;
/// Deferred appends gathered in memory before they are written in one go.
const UNWRITTEN_BYTES: usize = 1024 * 1024;
/// Default limit on one record's payload: twice the largest event the
/// decoder accepts, so the log never refuses an event the fold could read.
pub const DEFAULT_MAX_RECORD_BYTES: usize = 2 * crate::core::event::MAX_EVENT_BYTES;
/// Largest payload length the format allows; a larger length field is damage.
const FORMAT_MAX_RECORD_BYTES: usize = 1 << 30;
const SEGMENT_SUFFIX: &str = ".seg";
const LOCK_FILE: &str = "LOCK";
/// The head file's name and first four bytes (see the module doc).
const HEAD_FILE: &str = "HEAD";
const HEAD_MAGIC: [u8; 4] = *b"cfH1";

fn kind_byte(origin: Origin, encoding: Encoding) -> u8 {
    let base = match origin {
        Origin::Legacy => 1,
        Origin::Agent => 3,
        Origin::Service => 5,
    };
    match encoding {
        Encoding::Msgpack => base,
        Encoding::Json => base + 1,
    }
}

fn kind_from_byte(byte: u8) -> Option<(Origin, Encoding)> {
    let origin = match byte {
        1 | 2 => Origin::Legacy,
        3 | 4 => Origin::Agent,
        5 | 6 => Origin::Service,
        _ => return None,
    };
    let encoding = if byte % 2 == 1 {
        Encoding::Msgpack
    } else {
        Encoding::Json
    };
    Some((origin, encoding))
}

fn record_checksum(length: [u8; 4], encoding: u8, payload: &[u8]) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&length);
    hasher.update(&[encoding]);
    hasher.update(payload);
    hasher.finalize()
}

/// Appends one framed record to `out`. The caller has checked the size.
#[allow(clippy::expect_used)] // only a bug reaches the expect (see its message)
fn frame_record(out: &mut Vec<u8>, origin: Origin, encoding: Encoding, payload: &[u8]) {
    let length = u32::try_from(payload.len())
        .expect("payload length was checked against the record limit")
        .to_le_bytes();
    let enc = kind_byte(origin, encoding);
    out.extend_from_slice(&RECORD_MAGIC);
    out.extend_from_slice(&length);
    out.extend_from_slice(&record_checksum(length, enc, payload).to_le_bytes());
    out.push(enc);
    out.extend_from_slice(payload);
}

/// Tuning for [`SegmentLog::open_with`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentOptions {
    /// A new segment is started when a record would push the newest one
    /// past this size (a segment holds at least one record, so a single
    /// larger record still fits).
    pub segment_bytes: u64,
    /// Appends of a larger payload fail with [`LogError::TooLarge`].
    /// Capped at 1 GiB by the format.
    pub max_record_bytes: usize,
}

impl Default for SegmentOptions {
    fn default() -> Self {
        SegmentOptions {
            segment_bytes: DEFAULT_SEGMENT_BYTES,
            max_record_bytes: DEFAULT_MAX_RECORD_BYTES,
        }
    }
}

/// Records at the start of a segment that are known by count and size but
/// not indexed yet: a sealed segment (its count from the file names) or
/// the newest segment's part its head file vouches for (see the module
/// doc). Indexed, and verified, when a read first reaches the segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Unindexed {
    /// Records in the prefix.
    records: u64,
    /// Bytes the prefix spans: its records end exactly there.
    bytes: u64,
    /// Offset of the prefix's last record (0 when it has none).
    last_offset: u64,
    /// Whose word the prefix is taken on, for the error that contradicts it.
    source: PrefixSource,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PrefixSource {
    /// A sealed segment: its name and the next segment's.
    Sealed,
    /// The newest segment: the log's head file.
    Head,
}

/// One segment file and the offsets of its records.
#[derive(Debug)]
struct Segment {
    path: PathBuf,
    file: File,
    /// Position of the first record this segment holds (or will hold).
    first: Position,
    /// The records at the start of the segment not indexed yet.
    unindexed: Option<Unindexed>,
    /// Byte offset of each record after the unindexed prefix, in order.
    offsets: Vec<u64>,
    /// Bytes of valid records; the next append goes here.
    len: u64,
}

impl Segment {
    fn record_count(&self) -> u64 {
        self.unindexed.map_or(0, |u| u.records) + self.offsets.len() as u64
    }

    /// Offset of the segment's last record, if it has one.
    fn last_offset(&self) -> Option<u64> {
        match (self.offsets.last(), self.unindexed) {
            (Some(&offset), _) => Some(offset),
            (None, Some(u)) if u.records > 0 => Some(u.last_offset),
            _ => None,
        }
    }

    /// Scans the unindexed prefix the first time a read reaches the
    /// segment, checking that it holds the records its count says and ends
    /// where its size says. Any damage in it is corruption: those bytes
    /// were durable before anything vouched for them.
    fn ensure_indexed(&mut self) -> Result<(), LogError> {
        let Some(prefix) = self.unindexed else {
            return Ok(());
        };
        let scanned = scan_range(
            &self.path,
            &mut self.file,
            0,
            prefix.bytes,
            ScanRule::Durable,
        )?;
        let found = scanned.offsets.len() as u64;
        if found != prefix.records || scanned.valid_len != prefix.bytes {
            let detail = match prefix.source {
                PrefixSource::Sealed => format!(
                    "the segment holds {found} records but the next segment starts \
                     {} positions after it: a segment is missing or damaged",
                    prefix.records
                ),
                PrefixSource::Head => format!(
                    "the segment's first {} bytes hold {found} records but the log's head \
                     file says {} records end at byte {}: the segment was changed behind \
                     the log's back; delete {HEAD_FILE} to have the next open scan it",
                    scanned.valid_len, prefix.records, prefix.bytes
                ),
            };
            return Err(LogError::Corrupt {
                path: self.path.display().to_string(),
                offset: scanned.valid_len,
                detail,
            });
        }
        let mut offsets = scanned.offsets;
        offsets.append(&mut self.offsets);
        self.offsets = offsets;
        self.unindexed = None;
        Ok(())
    }

    fn read_exact_at(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        read_exact_at(&mut self.file, offset, buf)
    }
}

/// Reads `buf.len()` bytes at `offset`: one positioned read (`pread`) where
/// the platform has it. The fold reads back every record it folds, so a
/// seek before each read was a third of `run`'s system calls.
fn read_exact_at(file: &mut File, offset: u64, buf: &mut [u8]) -> io::Result<()> {
    #[cfg(unix)]
    {
        std::os::unix::fs::FileExt::read_exact_at(file, buf, offset)
    }
    #[cfg(not(unix))]
    {
        file.seek(SeekFrom::Start(offset))?;
        file.read_exact(buf)
    }
}

/// Writes all of `buf` at `offset`: one positioned write (`pwrite`) where
/// the platform has it (see [`read_exact_at`]).
fn write_all_at(file: &mut File, offset: u64, buf: &[u8]) -> io::Result<()> {
    #[cfg(unix)]
    {
        std::os::unix::fs::FileExt::write_all_at(file, buf, offset)
    }
    #[cfg(not(unix))]
    {
        use std::io::Write;
        file.seek(SeekFrom::Start(offset))?;
        file.write_all(buf)
    }
}

/// The embedded [`EventLog`]: see the module documentation for the format
/// and the crash-safety rules.
#[derive(Debug)]
pub struct SegmentLog {
    dir: PathBuf,
    options: SegmentOptions,
    /// Oldest first; never empty, the last one takes appends.
    segments: Vec<Segment>,
    dropped_tail_bytes: u64,
    /// The newest segment holds bytes written but not yet synced.
    unsynced: bool,
    /// Deferred appends not yet written to the newest segment's file:
    /// the framed records at the end of its `len` (see "Deferred appends"
    /// in the module doc).
    unwritten: Vec<u8>,
    /// Holds the directory's exclusive lock for as long as the log is open;
    /// released explicitly on drop (see the `Drop` impl).
    lock: File,
    /// The head file, once written by this handle.
    head_file: Option<File>,
}

impl Drop for SegmentLog {
    /// Releases the directory lock explicitly rather than by closing the
    /// file. The lock belongs to the open file description, and closing
    /// our descriptor frees it only if no other descriptor refers to that
    /// description; a child process forked by any thread of this process
    /// (e.g. `std::process::Command::spawn`) holds a copy of every
    /// descriptor until it execs, so a close alone could leave the log
    /// "already open" for a moment after it was dropped. Unlocking acts on
    /// the description itself, whoever else still refers to it.
    fn drop(&mut self) {
        // A clean drop leaves deferred appends in the file, unsynced, as
        // an append that wrote them at once did.
        if let Err(e) = self.write_unwritten() {
            tracing::warn!(
                dir = %self.dir.display(),
                "event log: writing deferred appends on close failed: {e}"
            );
        }
        if let Err(e) = self.lock.unlock() {
            tracing::warn!(
                dir = %self.dir.display(),
                "event log: releasing the directory lock failed: {e}"
            );
        }
    }
}

fn io_error(path: &Path) -> impl FnOnce(io::Error) -> LogError + '_ {
    move |source| LogError::Io {
        path: path.display().to_string(),
        source,
    }
}

fn segment_file_name(first: Position) -> String {
    format!("{first:020}{SEGMENT_SUFFIX}")
}

/// Makes a newly created directory entry durable.
fn sync_dir(dir: &Path) -> Result<(), LogError> {
    // Directories cannot be opened as files everywhere; where they can
    // (Unix), syncing one persists the entries created in it.
    if cfg!(unix) {
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io_error(dir))?;
    }
    Ok(())
}

/// Why the record at some offset is not valid.
enum Damage {
    /// Bytes that no completed append can have left: torn tail or corruption.
    Invalid(String),
    /// A record whose checksum holds but whose content this build cannot
    /// read (e.g. an encoding from a newer version): never truncated.
    Unreadable(String),
}

/// Reads the record header at the reader's position (`offset` bytes into a
/// file of `file_len` bytes) and validates the record, leaving the reader at
/// its end. Returns the record's total size.
fn check_record(
    reader: &mut impl Read,
    offset: u64,
    file_len: u64,
    payload: &mut Vec<u8>,
) -> io::Result<Result<u64, Damage>> {
    let remaining = file_len - offset;
    if remaining < RECORD_OVERHEAD {
        return Ok(Err(Damage::Invalid(format!(
            "partial record header ({remaining} of {RECORD_OVERHEAD} bytes)"
        ))));
    }
    let mut header = [0u8; RECORD_OVERHEAD as usize];
    reader.read_exact(&mut header)?;
    if header[0..4] != RECORD_MAGIC {
        return Ok(Err(Damage::Invalid("bad record magic".into())));
    }
    let length = [header[4], header[5], header[6], header[7]];
    let crc = u32::from_le_bytes([header[8], header[9], header[10], header[11]]);
    let enc = header[12];
    let size = u32::from_le_bytes(length) as usize;
    if size > FORMAT_MAX_RECORD_BYTES {
        return Ok(Err(Damage::Invalid(format!(
            "record length {size} exceeds the format's limit"
        ))));
    }
    if size as u64 > remaining - RECORD_OVERHEAD {
        return Ok(Err(Damage::Invalid(format!(
            "record of {size} bytes runs past the end of the file ({} bytes left)",
            remaining - RECORD_OVERHEAD
        ))));
    }
    payload.clear();
    payload.resize(size, 0);
    reader.read_exact(payload)?;
    if record_checksum(length, enc, payload) != crc {
        return Ok(Err(Damage::Invalid("checksum mismatch".into())));
    }
    if kind_from_byte(enc).is_none() {
        return Ok(Err(Damage::Unreadable(format!(
            "unknown kind byte {enc} (written by a newer version?)"
        ))));
    }
    Ok(Ok(RECORD_OVERHEAD + size as u64))
}

/// The offset of the first valid record that starts after `from`, if any.
/// Only called on damage, to tell a torn tail from corruption.
fn find_valid_record(file: &mut File, from: u64, file_len: u64) -> io::Result<Option<u64>> {
    const CHUNK: usize = 64 * 1024;
    let mut chunk = vec![0u8; CHUNK];
    let mut payload = Vec::new();
    let mut start = from;
    while start < file_len {
        let n = CHUNK.min((file_len - start) as usize);
        file.seek(SeekFrom::Start(start))?;
        file.read_exact(&mut chunk[..n])?;
        for i in 0..n {
            // Matches straddling chunks are found from the next chunk,
            // which starts just after the last complete window checked.
            if i + RECORD_MAGIC.len() > n {
                break;
            }
            if chunk[i..i + RECORD_MAGIC.len()] != RECORD_MAGIC {
                continue;
            }
            let candidate = start + i as u64;
            file.seek(SeekFrom::Start(candidate))?;
            let mut reader = BufReader::new(&mut *file);
            if let Ok(_size) = check_record(&mut reader, candidate, file_len, &mut payload)? {
                return Ok(Some(candidate));
            }
        }
        if start + n as u64 >= file_len {
            break;
        }
        start += (n - (RECORD_MAGIC.len() - 1)) as u64;
    }
    Ok(None)
}

/// What scanning a segment found.
struct ScannedSegment {
    offsets: Vec<u64>,
    valid_len: u64,
    /// Set when the segment ends in a torn tail: (offset, reason).
    torn_at: Option<(u64, String)>,
}

/// How a scan treats damage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ScanRule {
    /// Bytes of the newest segment no one vouched for: damage with no
    /// valid record after it is a torn tail.
    Tail,
    /// Bytes durable before something vouched for them (a sealed segment,
    /// or the part of the newest one the head file names): any damage is
    /// corruption.
    Durable,
}

/// Scans the records in bytes `[from, to)` of a segment file (`to` at most
/// its length) and verifies their checksums.
fn scan_range(
    path: &Path,
    file: &mut File,
    from: u64,
    to: u64,
    rule: ScanRule,
) -> Result<ScannedSegment, LogError> {
    file.seek(SeekFrom::Start(from)).map_err(io_error(path))?;
    let mut reader = BufReader::with_capacity(1 << 20, &mut *file);
    let mut offsets = Vec::new();
    let mut payload = Vec::new();
    let mut offset = from;
    let damage = loop {
        if offset == to {
            break None;
        }
        match check_record(&mut reader, offset, to, &mut payload).map_err(io_error(path))? {
            Ok(size) => {
                offsets.push(offset);
                offset += size;
            }
            Err(damage) => break Some(damage),
        }
    };
    drop(reader);
    let corrupt = |detail: String| LogError::Corrupt {
        path: path.display().to_string(),
        offset,
        detail,
    };
    match damage {
        None => Ok(ScannedSegment {
            offsets,
            valid_len: offset,
            torn_at: None,
        }),
        Some(Damage::Unreadable(detail)) => Err(corrupt(detail)),
        Some(Damage::Invalid(detail)) if rule == ScanRule::Durable => Err(corrupt(format!(
            "{detail}, in a sealed segment or the synced part of the newest one \
             (only bytes appended after the last sync can be a torn tail)"
        ))),
        Some(Damage::Invalid(detail)) => {
            match find_valid_record(file, offset + 1, to).map_err(io_error(path))? {
                Some(next) => Err(corrupt(format!(
                    "{detail}, but a valid record follows at byte {next}, so this is \
                     not a torn tail from a crash; restore the log from a replica or \
                     truncate the file at byte {offset} by hand to drop everything after it"
                ))),
                None => Ok(ScannedSegment {
                    offsets,
                    valid_len: offset,
                    torn_at: Some((offset, detail)),
                }),
            }
        }
    }
}

/// The log's head file: how far the newest segment was synced when it was
/// last written (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Head {
    /// First position of the segment it describes (its file name).
    first: Position,
    records: u64,
    bytes: u64,
    /// Offset of the last of those records (0 when there are none).
    last_offset: u64,
}

impl Head {
    const LEN: usize = 4 + 8 * 4 + 4;

    fn encode(&self) -> [u8; Head::LEN] {
        let mut out = [0u8; Head::LEN];
        out[0..4].copy_from_slice(&HEAD_MAGIC);
        for (i, v) in [self.first, self.records, self.bytes, self.last_offset]
            .into_iter()
            .enumerate()
        {
            out[4 + 8 * i..12 + 8 * i].copy_from_slice(&v.to_le_bytes());
        }
        let crc = crc32fast::hash(&out[..Head::LEN - 4]);
        out[Head::LEN - 4..].copy_from_slice(&crc.to_le_bytes());
        out
    }

    /// The head a file holds, or why it is not usable (then the newest
    /// segment is scanned whole, as if there were none).
    fn decode(bytes: &[u8]) -> Result<Head, &'static str> {
        if bytes.len() != Head::LEN || bytes[0..4] != HEAD_MAGIC {
            return Err("not a head file of this format");
        }
        let crc = u32::from_le_bytes([
            bytes[Head::LEN - 4],
            bytes[Head::LEN - 3],
            bytes[Head::LEN - 2],
            bytes[Head::LEN - 1],
        ]);
        if crc32fast::hash(&bytes[..Head::LEN - 4]) != crc {
            return Err("checksum mismatch");
        }
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&bytes[4 + 8 * i..12 + 8 * i]);
            u64::from_le_bytes(w)
        };
        Ok(Head {
            first: word(0),
            records: word(1),
            bytes: word(2),
            last_offset: word(3),
        })
    }

    /// Whether the newest segment (`file`, `file_len` bytes, first
    /// position `first`) still agrees with this head, checked at the cost
    /// of one record: it names this segment, the file is at least as long,
    /// and the last record it names is valid and ends exactly where it says.
    fn agrees_with(
        &self,
        first: Position,
        file: &mut File,
        file_len: u64,
    ) -> io::Result<Result<(), String>> {
        if self.first != first {
            return Ok(Err(format!(
                "it describes the segment starting at {}, not the newest ({first})",
                self.first
            )));
        }
        if self.bytes > file_len {
            return Ok(Err(format!(
                "it names {} bytes but the segment holds {file_len}",
                self.bytes
            )));
        }
        if self.records == 0 || self.records > self.bytes / RECORD_OVERHEAD {
            return Ok(if self.records == 0 && self.bytes == 0 {
                Ok(())
            } else {
                Err(format!(
                    "{} records cannot span {} bytes",
                    self.records, self.bytes
                ))
            });
        }
        if self.last_offset >= self.bytes {
            return Ok(Err("its last record starts past its end".into()));
        }
        file.seek(SeekFrom::Start(self.last_offset))?;
        let mut reader = BufReader::new(&mut *file);
        let mut payload = Vec::new();
        Ok(
            match check_record(&mut reader, self.last_offset, file_len, &mut payload)? {
                Ok(size) if self.last_offset + size == self.bytes => Ok(()),
                Ok(_) => Err("its last record does not end where it says".into()),
                Err(Damage::Invalid(d) | Damage::Unreadable(d)) => {
                    Err(format!("its last record is not valid: {d}"))
                }
            },
        )
    }
}

/// The head file of the log in `dir`: `None` when there is none (a log
/// written before head files, or never synced), `Some(Err(why))` when it
/// cannot be used.
fn read_head(dir: &Path) -> Option<Result<Head, String>> {
    match fs::read(dir.join(HEAD_FILE)) {
        Ok(bytes) => Some(Head::decode(&bytes).map_err(String::from)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => Some(Err(format!("reading it failed: {e}"))),
    }
}

impl SegmentLog {
    /// Opens (creating if needed) the log in `dir` with default options.
    pub fn open(dir: &Path) -> Result<Self, LogError> {
        Self::open_with(dir, SegmentOptions::default())
    }

    /// Opens (creating if needed) the log in `dir`: takes the directory lock,
    /// scans and verifies what the newest segment holds past its `HEAD`
    /// (all of it, without a usable one), and truncates a torn tail (the
    /// rest is verified when a read first reaches it: see the module doc).
    pub fn open_with(dir: &Path, options: SegmentOptions) -> Result<Self, LogError> {
        let options = SegmentOptions {
            segment_bytes: options.segment_bytes.max(1),
            max_record_bytes: options.max_record_bytes.min(FORMAT_MAX_RECORD_BYTES),
        };
        fs::create_dir_all(dir).map_err(io_error(dir))?;
        let lock_path = dir.join(LOCK_FILE);
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io_error(&lock_path))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => {
                return Err(LogError::Backend(
                    format!(
                        "event log at {} is already open in another process or handle; \
                         stop it or choose another --data directory",
                        dir.display()
                    )
                    .into(),
                ))
            }
            Err(fs::TryLockError::Error(source)) => return Err(io_error(&lock_path)(source)),
        }

        let mut firsts = Vec::new();
        for entry in fs::read_dir(dir).map_err(io_error(dir))? {
            let entry = entry.map_err(io_error(dir))?;
            let name = entry.file_name();
            let Some(stem) = name.to_str().and_then(|n| n.strip_suffix(SEGMENT_SUFFIX)) else {
                continue;
            };
            match stem.parse::<Position>() {
                Ok(first) if first >= 1 => firsts.push(first),
                _ => {
                    return Err(LogError::Corrupt {
                        path: entry.path().display().to_string(),
                        offset: 0,
                        detail: "segment file name is not a record position \
                                 (expected 20 digits and .seg); move the file out \
                                 of the log directory"
                            .into(),
                    })
                }
            }
        }
        firsts.sort_unstable();

        let mut log = SegmentLog {
            dir: dir.to_path_buf(),
            options,
            segments: Vec::with_capacity(firsts.len().max(1)),
            dropped_tail_bytes: 0,
            unsynced: false,
            unwritten: Vec::new(),
            lock,
            head_file: None,
        };
        if firsts.is_empty() {
            log.create_segment(1)?;
            return Ok(log);
        }
        let head = read_head(dir);
        let mut truncated = false;
        for (i, &first) in firsts.iter().enumerate() {
            let path = dir.join(segment_file_name(first));
            let mut file = OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(io_error(&path))?;
            let file_len = file.metadata().map_err(io_error(&path))?.len();
            if let Some(&next) = firsts.get(i + 1) {
                // Sealed: indexed when first read (see the module doc).
                log.segments.push(Segment {
                    path,
                    file,
                    first,
                    unindexed: Some(Unindexed {
                        records: next - first,
                        bytes: file_len,
                        last_offset: 0,
                        source: PrefixSource::Sealed,
                    }),
                    offsets: Vec::new(),
                    len: file_len,
                });
                continue;
            }
            // The newest segment: what the head vouches for is taken on its
            // word (checked by its last record), the rest is scanned.
            let vouched = match &head {
                Some(Ok(head)) => match head
                    .agrees_with(first, &mut file, file_len)
                    .map_err(io_error(&path))?
                {
                    Ok(()) => Some(*head),
                    Err(why) => {
                        tracing::warn!(
                            path = %path.display(),
                            reason = %why,
                            "event log: the head file does not match the newest segment; scanning it whole"
                        );
                        None
                    }
                },
                Some(Err(why)) => {
                    tracing::warn!(
                        dir = %dir.display(),
                        reason = %why,
                        "event log: the head file is not usable; scanning the newest segment whole"
                    );
                    None
                }
                None => None,
            };
            let from = vouched.map_or(0, |h| h.bytes);
            let scanned = scan_range(&path, &mut file, from, file_len, ScanRule::Tail)?;
            if let Some((offset, reason)) = scanned.torn_at {
                let dropped = file_len - offset;
                file.set_len(offset).map_err(io_error(&path))?;
                file.sync_all().map_err(io_error(&path))?;
                tracing::warn!(
                    path = %path.display(),
                    offset,
                    dropped_bytes = dropped,
                    reason = %reason,
                    "event log: truncated a torn tail left by an interrupted append"
                );
                log.dropped_tail_bytes += dropped;
                truncated = true;
            }
            log.segments.push(Segment {
                path,
                file,
                first,
                unindexed: vouched.filter(|h| h.records > 0).map(|h| Unindexed {
                    records: h.records,
                    bytes: h.bytes,
                    last_offset: h.last_offset,
                    source: PrefixSource::Head,
                }),
                offsets: scanned.offsets,
                len: scanned.valid_len,
            });
        }
        if truncated {
            // The open changed the segment anyway, and what it kept is on
            // disk (read back from the file, the truncation synced): the
            // next open need not scan it again. An open that changed
            // nothing writes nothing (reading never rewrites the log); the
            // next sync moves the head.
            log.write_head();
        }
        Ok(log)
    }

    /// Records the newest segment's synced extent in the head file. Called
    /// only when everything in the newest segment is durable. Not synced
    /// itself, and a failure only costs the next open a longer scan: an
    /// older or lost head file still describes synced bytes (see the
    /// module doc).
    fn write_head(&mut self) {
        let newest = &self.segments[self.segments.len() - 1];
        let head = Head {
            first: newest.first,
            records: newest.record_count(),
            bytes: newest.len,
            last_offset: newest.last_offset().unwrap_or(0),
        };
        let path = self.dir.join(HEAD_FILE);
        let written = match &mut self.head_file {
            Some(file) => Ok(file),
            None => OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)
                .map(|file| self.head_file.insert(file)),
        }
        .and_then(|file| write_all_at(file, 0, &head.encode()));
        if let Err(e) = written {
            self.head_file = None;
            tracing::warn!(
                path = %path.display(),
                "event log: writing the head file failed (the next open scans the newest segment): {e}"
            );
        }
    }

    fn create_segment(&mut self, first: Position) -> Result<(), LogError> {
        let path = self.dir.join(segment_file_name(first));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(io_error(&path))?;
        // The new file's directory entry must be durable before any record
        // in it is acknowledged.
        sync_dir(&self.dir)?;
        self.segments.push(Segment {
            path,
            file,
            first,
            unindexed: None,
            offsets: Vec::new(),
            len: 0,
        });
        Ok(())
    }

    #[allow(clippy::expect_used)] // only a bug reaches the expect (see its message)
    fn newest(&mut self) -> &mut Segment {
        self.segments
            .last_mut()
            .expect("a segment log always has a newest segment")
    }

    /// Directory the log lives in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Bytes of a torn tail truncated when this log was opened (0 when the
    /// log was closed cleanly).
    pub fn dropped_tail_bytes(&self) -> u64 {
        self.dropped_tail_bytes
    }

    /// Number of segment files.
    pub fn segment_count(&self) -> usize {
        self.segments.len()
    }

    /// Total bytes of valid records on disk.
    pub fn size_bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.len).sum()
    }

    /// Position of the newest record (0 when empty).
    pub fn last_position_sync(&self) -> Position {
        let newest = &self.segments[self.segments.len() - 1];
        newest.first + newest.record_count() - 1
    }

    fn check_size(&self, payload: &[u8]) -> Result<(), LogError> {
        if payload.len() > self.options.max_record_bytes {
            return Err(LogError::TooLarge {
                size: payload.len(),
                limit: self.options.max_record_bytes,
            });
        }
        Ok(())
    }

    /// Appends one record; it is on disk (fdatasync'd) when this returns.
    pub fn append_sync(
        &mut self,
        origin: Origin,
        encoding: Encoding,
        bytes: &[u8],
    ) -> Result<Position, LogError> {
        self.check_size(bytes)?;
        let mut frame = Vec::with_capacity(RECORD_OVERHEAD as usize + bytes.len());
        frame_record(&mut frame, origin, encoding, bytes);
        self.roll_if_full(frame.len() as u64)?;
        self.write_frames(&frame, &[0])?;
        Ok(self.last_position_sync())
    }

    /// Appends every record with one fdatasync (one per segment touched,
    /// when the batch crosses a segment boundary). Returns the position of
    /// the last record; an empty batch writes nothing and returns the
    /// current last position. No record is written if any is too large.
    /// If an I/O error interrupts a batch that crosses a segment boundary,
    /// the records already synced into the earlier segment stay in the log
    /// (the caller sees the error and may re-append; events are idempotent).
    pub fn append_batch_sync(&mut self, records: &[Appended]) -> Result<Position, LogError> {
        for (_, _, bytes) in records {
            self.check_size(bytes)?;
        }
        let mut frames = Vec::new();
        let mut starts = Vec::new();
        for (origin, encoding, bytes) in records {
            let size = RECORD_OVERHEAD + bytes.len() as u64;
            let newest_len = self.segments[self.segments.len() - 1].len;
            let would_be = newest_len + frames.len() as u64 + size;
            if newest_len + frames.len() as u64 > 0 && would_be > self.options.segment_bytes {
                if !frames.is_empty() {
                    self.write_frames(&frames, &starts)?;
                    frames.clear();
                    starts.clear();
                }
                self.roll_if_full(size)?;
            }
            starts.push(frames.len() as u64);
            frame_record(&mut frames, *origin, *encoding, bytes);
        }
        if !frames.is_empty() {
            self.write_frames(&frames, &starts)?;
        }
        Ok(self.last_position_sync())
    }

    /// Starts a new segment when a record of `size` bytes would overfill a
    /// non-empty newest segment.
    fn roll_if_full(&mut self, size: u64) -> Result<(), LogError> {
        let segment_bytes = self.options.segment_bytes;
        if self.newest().len > 0 && self.newest().len + size > segment_bytes {
            // A segment is complete only once it is on disk.
            self.sync_now()?;
        }
        let newest = self.newest();
        if newest.len > 0 && newest.len + size > segment_bytes {
            let next = newest.first + newest.record_count();
            self.create_segment(next)?;
            // Empty, hence wholly synced: the head moves to it.
            self.write_head();
        }
        Ok(())
    }

    /// Writes framed records at the end of the newest segment and syncs;
    /// `starts` are the records' offsets within `frames`. The index is
    /// extended only once the bytes are durable.
    fn write_frames(&mut self, frames: &[u8], starts: &[u64]) -> Result<(), LogError> {
        self.write_unwritten()?;
        let newest = self.newest();
        let base = newest.len;
        let written =
            write_all_at(&mut newest.file, base, frames).and_then(|()| newest.file.sync_data());
        if let Err(source) = written {
            // Best effort: drop the partial write now rather than leave it
            // for the next open to find as a torn tail. Later appends
            // overwrite from `base` either way.
            let _ = newest.file.set_len(base);
            return Err(io_error(&newest.path)(source));
        }
        newest.offsets.extend(starts.iter().map(|s| base + s));
        newest.len = base + frames.len() as u64;
        // The fdatasync covered every byte of the file, deferred ones
        // included.
        self.unsynced = false;
        self.write_head();
        Ok(())
    }

    /// Appends one record without waiting for the disk; it is readable at
    /// once and durable after the next [`SegmentLog::sync_now`] (a crash
    /// before that loses it, and every later record, never a middle one).
    pub fn append_deferred(
        &mut self,
        origin: Origin,
        encoding: Encoding,
        bytes: &[u8],
    ) -> Result<Position, LogError> {
        self.check_size(bytes)?;
        self.roll_if_full(RECORD_OVERHEAD + bytes.len() as u64)?;
        // Framed straight into the records gathered in memory, and written
        // once a mebibyte is (module doc).
        let newest = self.newest();
        newest.offsets.push(newest.len);
        newest.len += RECORD_OVERHEAD + bytes.len() as u64;
        frame_record(&mut self.unwritten, origin, encoding, bytes);
        self.unsynced = true;
        if self.unwritten.len() >= UNWRITTEN_BYTES {
            self.write_unwritten()?;
        }
        Ok(self.last_position_sync())
    }

    /// Writes the deferred appends gathered in memory to the newest
    /// segment's file (not synced). If the write fails they are dropped
    /// from the log, as a crash would drop them, and the error says so.
    fn write_unwritten(&mut self) -> Result<(), LogError> {
        if self.unwritten.is_empty() {
            return Ok(());
        }
        let bytes = std::mem::take(&mut self.unwritten);
        let newest = self.newest();
        let base = newest.len - bytes.len() as u64;
        if let Err(source) = write_all_at(&mut newest.file, base, &bytes) {
            // Best effort, as in `write_frames`: the records go, the file
            // is cut where they started.
            let _ = newest.file.set_len(base);
            let kept = newest.offsets.partition_point(|&o| o < base);
            newest.offsets.truncate(kept);
            newest.len = base;
            return Err(io_error(&newest.path)(source));
        }
        // The allocation is kept for the next appends.
        self.unwritten = bytes;
        self.unwritten.clear();
        Ok(())
    }

    /// The position of the first deferred append still in memory.
    fn first_unwritten(&self) -> Option<Position> {
        if self.unwritten.is_empty() {
            return None;
        }
        let newest = &self.segments[self.segments.len() - 1];
        let at = newest.len - self.unwritten.len() as u64;
        let indexed = newest.offsets.partition_point(|&o| o < at) as u64;
        Some(newest.first + newest.unindexed.map_or(0, |u| u.records) + indexed)
    }

    /// Makes every deferred append durable.
    pub fn sync_now(&mut self) -> Result<(), LogError> {
        self.write_unwritten()?;
        if self.unsynced {
            let newest = self.newest();
            newest.file.sync_data().map_err(io_error(&newest.path))?;
            self.unsynced = false;
            self.write_head();
        }
        Ok(())
    }

    /// [`SegmentLog::sync_now`] on a thread of its own while this one runs
    /// `work`; both have finished when it returns. The sync is mostly a
    /// wait on the disk (`run` spends about 4 ms a batch in it), which
    /// `work` (a state commit's encoding) no longer waits behind. With
    /// nothing to sync, or no thread to be had, the two run here in turn.
    pub fn sync_beside<T>(&mut self, work: impl FnOnce() -> T) -> (Result<(), LogError>, T) {
        if self.unwritten.is_empty() && !self.unsynced {
            return (Ok(()), work());
        }
        let beside = std::thread::scope(|scope| {
            let sync_thread = std::thread::Builder::new()
                .name("log-sync".into())
                .spawn_scoped(scope, || self.sync_now());
            match sync_thread {
                Ok(syncing) => {
                    let done = work();
                    // The sync thread panics only on a bug: carried here.
                    let synced = syncing
                        .join()
                        .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
                    Ok((synced, done))
                }
                Err(_) => Err(work),
            }
        });
        // No thread to be had: in turn, the work first as without one.
        beside.unwrap_or_else(|work| {
            let done = work();
            (self.sync_now(), done)
        })
    }

    /// Reads up to `max` records with position > `after`, in order,
    /// verifying each checksum.
    pub fn read_after_sync(
        &mut self,
        after: Position,
        max: usize,
    ) -> Result<Vec<LogRecord>, LogError> {
        let last = self.last_position_sync();
        let oldest = self.segments[0].first;
        let mut position = after.saturating_add(1).max(oldest);
        let end = after.saturating_add(max as u64).min(last);
        let mut out = Vec::new();
        if max == 0 || position > end {
            return Ok(out);
        }
        // A read either ends before the deferred appends still in memory
        // or starts at or after them: one that would take both writes them
        // first.
        if self
            .first_unwritten()
            .is_some_and(|first| position < first && end >= first)
        {
            self.write_unwritten()?;
        }
        out.reserve((end - position + 1) as usize);
        let newest = self.segments.len() - 1;
        while position <= end {
            let index = self.segments.partition_point(|s| s.first <= position) - 1;
            let segment = &mut self.segments[index];
            segment.ensure_indexed()?;
            let from = (position - segment.first) as usize;
            let to = ((end - segment.first + 1) as usize).min(segment.offsets.len());
            let start_offset = segment.offsets[from];
            let end_offset = segment.offsets.get(to).copied().unwrap_or(segment.len);
            let unwritten_at = (index == newest && !self.unwritten.is_empty())
                .then(|| segment.len - self.unwritten.len() as u64)
                .filter(|&at| start_offset >= at);
            let read;
            let buf: &[u8] = if let Some(unwritten_at) = unwritten_at {
                let at = (start_offset - unwritten_at) as usize;
                &self.unwritten[at..at + (end_offset - start_offset) as usize]
            } else {
                let mut bytes = vec![0u8; (end_offset - start_offset) as usize];
                segment
                    .read_exact_at(start_offset, &mut bytes)
                    .map_err(io_error(&segment.path))?;
                read = bytes;
                &read
            };
            for (i, &offset) in segment.offsets[from..to].iter().enumerate() {
                let at = (offset - start_offset) as usize;
                let record = decode_frame(&buf[at..]).map_err(|detail| LogError::Corrupt {
                    path: segment.path.display().to_string(),
                    offset,
                    detail,
                })?;
                let (origin, encoding, bytes) = record;
                out.push(LogRecord::unaddressed(
                    segment.first + (from + i) as u64,
                    origin,
                    encoding,
                    bytes.to_vec(),
                ));
            }
            position = segment.first + to as u64;
        }
        Ok(out)
    }

    /// Every record in order. For tests, tools and small logs: the whole log
    /// is held in memory.
    pub fn read_all_sync(&mut self) -> Result<Vec<LogRecord>, LogError> {
        self.read_after_sync(0, usize::MAX)
    }
}

/// Decodes the record at the start of `buf` (which the index says holds a
/// whole record), re-verifying it: the file may have changed since open.
fn decode_frame(buf: &[u8]) -> Result<(Origin, Encoding, &[u8]), String> {
    if buf.len() < RECORD_OVERHEAD as usize || buf[0..4] != RECORD_MAGIC {
        return Err("record changed on disk since the log was opened (bad magic)".into());
    }
    let length = [buf[4], buf[5], buf[6], buf[7]];
    let crc = u32::from_le_bytes([buf[8], buf[9], buf[10], buf[11]]);
    let enc = buf[12];
    let size = u32::from_le_bytes(length) as usize;
    let payload = buf
        .get(RECORD_OVERHEAD as usize..RECORD_OVERHEAD as usize + size)
        .ok_or("record changed on disk since the log was opened (bad length)")?;
    if record_checksum(length, enc, payload) != crc {
        return Err("checksum mismatch on read".into());
    }
    let (origin, encoding) = kind_from_byte(enc).ok_or(format!("unknown kind byte {enc}"))?;
    Ok((origin, encoding, payload))
}

impl EventLog for SegmentLog {
    async fn append(
        &mut self,
        origin: Origin,
        encoding: Encoding,
        bytes: &[u8],
    ) -> Result<Position, LogError> {
        self.append_sync(origin, encoding, bytes)
    }

    async fn append_batch(&mut self, records: &[Appended]) -> Result<Position, LogError> {
        self.append_batch_sync(records)
    }

    async fn read_after(
        &mut self,
        after: Position,
        max: usize,
    ) -> Result<Vec<LogRecord>, LogError> {
        self.read_after_sync(after, max)
    }

    async fn last_position(&mut self) -> Result<Position, LogError> {
        Ok(self.last_position_sync())
    }

    async fn append_deferred(
        &mut self,
        origin: Origin,
        encoding: Encoding,
        bytes: &[u8],
    ) -> Result<Position, LogError> {
        SegmentLog::append_deferred(self, origin, encoding, bytes)
    }

    async fn sync(&mut self) -> Result<(), LogError> {
        self.sync_now()
    }

    async fn sync_while<T>(&mut self, work: impl FnOnce() -> T) -> (Result<(), LogError>, T) {
        self.sync_beside(work)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn payload(i: usize) -> Vec<u8> {
        format!("event number {i} {}", "x".repeat(i % 37)).into_bytes()
    }

    fn encoding_of(i: usize) -> Encoding {
        if i.is_multiple_of(3) {
            Encoding::Json
        } else {
            Encoding::Msgpack
        }
    }

    /// A log in a fresh directory with `n` records appended and synced
    /// ([`fill`]); the directory lives as long as the guard.
    fn filled(n: usize) -> (tempfile::TempDir, SegmentLog) {
        let dir = tempfile::tempdir().unwrap();
        let mut log = SegmentLog::open(dir.path()).unwrap();
        fill(&mut log, n);
        (dir, log)
    }

    fn fill(log: &mut SegmentLog, n: usize) {
        for i in 0..n {
            let pos = log
                .append_sync(Origin::Agent, encoding_of(i), &payload(i))
                .unwrap();
            assert_eq!(pos, i as u64 + 1);
        }
    }

    fn check_all(log: &mut SegmentLog, n: usize) {
        let all = log.read_all_sync().unwrap();
        assert_eq!(all.len(), n);
        for (i, r) in all.iter().enumerate() {
            assert_eq!(r.position, i as u64 + 1);
            assert_eq!(r.encoding, encoding_of(i));
            assert_eq!(r.bytes, payload(i));
        }
    }

    fn newest_path(log: &SegmentLog) -> PathBuf {
        log.segments[log.segments.len() - 1].path.clone()
    }

    #[test]
    fn empty_log_reads_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = SegmentLog::open(dir.path()).unwrap();
        assert_eq!(log.last_position_sync(), 0);
        assert!(log.read_after_sync(0, 10).unwrap().is_empty());
        assert!(log.read_all_sync().unwrap().is_empty());
        drop(log);
        let mut log = SegmentLog::open(dir.path()).unwrap();
        assert_eq!(log.last_position_sync(), 0);
        assert_eq!(log.dropped_tail_bytes(), 0);
        assert!(log.read_after_sync(5, 10).unwrap().is_empty());
    }

    #[test]
    fn append_then_read_after_windows() {
        let (_dir, mut log) = filled(50);
        check_all(&mut log, 50);
        let window = log.read_after_sync(10, 5).unwrap();
        let positions: Vec<_> = window.iter().map(|r| r.position).collect();
        assert_eq!(positions, vec![11, 12, 13, 14, 15]);
        assert_eq!(window[0].bytes, payload(10));
        assert_eq!(log.read_after_sync(48, 100).unwrap().len(), 2);
        assert!(log.read_after_sync(50, 100).unwrap().is_empty());
        assert!(log.read_after_sync(3, 0).unwrap().is_empty());
        assert_eq!(
            log.read_after_sync(u64::MAX - 1, usize::MAX).unwrap().len(),
            0
        );
    }

    #[test]
    fn empty_payload_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = SegmentLog::open(dir.path()).unwrap();
        log.append_sync(Origin::Agent, Encoding::Json, b"").unwrap();
        log.append_sync(Origin::Agent, Encoding::Msgpack, b"after")
            .unwrap();
        drop(log);
        let mut log = SegmentLog::open(dir.path()).unwrap();
        let all = log.read_all_sync().unwrap();
        assert_eq!(&all[0].bytes[..], b"");
        assert_eq!(all[0].encoding, Encoding::Json);
        assert_eq!(&all[1].bytes[..], b"after");
    }

    #[test]
    fn reopen_keeps_records_and_continues_numbering() {
        let (dir, log) = filled(20);
        drop(log);
        let mut log = SegmentLog::open(dir.path()).unwrap();
        assert_eq!(log.last_position_sync(), 20);
        assert_eq!(log.dropped_tail_bytes(), 0);
        check_all(&mut log, 20);
        assert_eq!(
            log.append_sync(Origin::Agent, Encoding::Json, b"next")
                .unwrap(),
            21
        );
    }

    #[test]
    fn second_open_of_the_same_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let _log = SegmentLog::open(dir.path()).unwrap();
        let err = SegmentLog::open(dir.path()).unwrap_err();
        assert!(
            matches!(err, LogError::Backend(ref m) if m.to_string().contains("already open")),
            "{err}"
        );
    }

    #[test]
    fn dropping_the_log_releases_its_lock_even_if_its_descriptor_was_copied() {
        // A child process forked while the log is open holds a copy of the
        // lock's descriptor until it execs; a copy made here stands for it.
        let dir = tempfile::tempdir().unwrap();
        let log = SegmentLog::open(dir.path()).unwrap();
        let inherited = log.lock.try_clone().unwrap();
        drop(log);
        let reopened = SegmentLog::open(dir.path());
        assert!(reopened.is_ok(), "{:?}", reopened.err());
        drop(inherited);
    }

    #[test]
    fn batch_appends_in_order_and_returns_last_position() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = SegmentLog::open(dir.path()).unwrap();
        log.append_sync(Origin::Agent, Encoding::Json, &payload(0))
            .unwrap();
        let batch: Vec<_> = (1..100)
            .map(|i| (Origin::Agent, encoding_of(i), payload(i)))
            .collect();
        assert_eq!(log.append_batch_sync(&batch).unwrap(), 100);
        assert_eq!(log.append_batch_sync(&[]).unwrap(), 100);
        check_all(&mut log, 100);
        drop(log);
        let mut log = SegmentLog::open(dir.path()).unwrap();
        check_all(&mut log, 100);
    }

    #[test]
    fn too_large_records_are_refused_and_batches_write_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let options = SegmentOptions {
            max_record_bytes: 100,
            ..SegmentOptions::default()
        };
        let mut log = SegmentLog::open_with(dir.path(), options).unwrap();
        assert!(log
            .append_sync(Origin::Agent, Encoding::Json, &[b'a'; 100])
            .is_ok());
        let err = log
            .append_sync(Origin::Agent, Encoding::Json, &[b'a'; 101])
            .unwrap_err();
        assert!(matches!(
            err,
            LogError::TooLarge {
                size: 101,
                limit: 100
            }
        ));
        let batch = vec![
            (Origin::Agent, Encoding::Json, vec![b'a'; 10]),
            (Origin::Agent, Encoding::Json, vec![b'a'; 1000]),
        ];
        assert!(matches!(
            log.append_batch_sync(&batch),
            Err(LogError::TooLarge { size: 1000, .. })
        ));
        assert_eq!(log.last_position_sync(), 1);
    }

    #[test]
    fn torn_tail_of_partial_record_is_truncated() {
        let (dir, log) = filled(10);
        let path = newest_path(&log);
        let clean_len = log.size_bytes();
        drop(log);

        // A record whose header made it to disk but whose payload did not.
        let mut frame = Vec::new();
        frame_record(&mut frame, Origin::Agent, Encoding::Json, &[7u8; 300]);
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(&frame[..100]).unwrap();
        drop(f);

        let mut log = SegmentLog::open(dir.path()).unwrap();
        assert_eq!(log.dropped_tail_bytes(), 100);
        assert_eq!(fs::metadata(&path).unwrap().len(), clean_len);
        check_all(&mut log, 10);
        assert_eq!(
            log.append_sync(Origin::Agent, Encoding::Json, b"after")
                .unwrap(),
            11
        );
        drop(log);
        let mut log = SegmentLog::open(dir.path()).unwrap();
        assert_eq!(log.dropped_tail_bytes(), 0);
        assert_eq!(&log.read_after_sync(10, 1).unwrap()[0].bytes[..], b"after");
    }

    #[test]
    fn torn_tail_of_garbage_and_partial_header_is_truncated() {
        for garbage in [
            vec![0u8; 4096],
            b"cfL".to_vec(),
            b"junk after crash".to_vec(),
        ] {
            let (dir, log) = filled(5);
            let path = newest_path(&log);
            drop(log);
            let mut f = OpenOptions::new().append(true).open(&path).unwrap();
            f.write_all(&garbage).unwrap();
            drop(f);
            let mut log = SegmentLog::open(dir.path()).unwrap();
            assert_eq!(log.dropped_tail_bytes(), garbage.len() as u64);
            check_all(&mut log, 5);
        }
    }

    #[test]
    fn torn_tail_with_bad_checksum_in_last_record_is_truncated() {
        let (dir, log) = filled(5);
        let last_offset = *log.segments[0].offsets.last().unwrap();
        let len = log.size_bytes();
        let path = newest_path(&log);
        drop(log);
        flip_byte(&path, len - 1);
        let mut log = SegmentLog::open(dir.path()).unwrap();
        assert_eq!(log.dropped_tail_bytes(), len - last_offset);
        check_all(&mut log, 4);
    }

    fn flip_byte(path: &Path, offset: u64) {
        let mut bytes = fs::read(path).unwrap();
        bytes[offset as usize] ^= 0x40;
        fs::write(path, bytes).unwrap();
    }

    #[test]
    fn damage_in_the_middle_is_corruption_naming_the_offset() {
        let (dir, log) = filled(10);
        let path = newest_path(&log);
        let len_before = log.size_bytes();
        let offsets = log.segments[0].offsets.clone();
        drop(log);
        // Without a head file the whole segment is scanned on open (for
        // damage in what the head vouches for, see
        // `damage_in_what_the_head_vouches_for_is_found_by_the_first_read`);
        // an open that fails writes none.
        fs::remove_file(dir.path().join(HEAD_FILE)).unwrap();

        // A payload byte of record 4, then (separately) its length field.
        for (flip_at, _what) in [
            (offsets[3] + RECORD_OVERHEAD + 2, "payload"),
            (offsets[3] + 5, "length"),
        ] {
            flip_byte(&path, flip_at);
            let err = SegmentLog::open(dir.path()).unwrap_err();
            match &err {
                LogError::Corrupt { offset, detail, .. } => {
                    assert_eq!(*offset, offsets[3], "{err}");
                    assert!(
                        detail.contains(&format!("valid record follows at byte {}", offsets[4])),
                        "{err}"
                    );
                }
                other => panic!("expected Corrupt, got {other}"),
            }
            assert!(err.to_string().contains(&format!("at byte {}", offsets[3])));
            // Nothing was truncated.
            assert_eq!(fs::metadata(&path).unwrap().len(), len_before);
            flip_byte(&path, flip_at);
        }
        let mut log = SegmentLog::open(dir.path()).unwrap();
        check_all(&mut log, 10);
    }

    /// A log of 30 records in segments of 200 bytes (several sealed ones).
    fn rolled_log() -> (tempfile::TempDir, SegmentOptions, SegmentLog) {
        let dir = tempfile::tempdir().unwrap();
        let options = SegmentOptions {
            segment_bytes: 200,
            ..SegmentOptions::default()
        };
        let mut log = SegmentLog::open_with(dir.path(), options).unwrap();
        fill(&mut log, 30);
        (dir, options, log)
    }

    #[test]
    fn segments_roll_and_read_across_boundaries() {
        let (dir, options, mut log) = rolled_log();
        let batch: Vec<_> = (30..60)
            .map(|i| (Origin::Agent, encoding_of(i), payload(i)))
            .collect();
        assert_eq!(log.append_batch_sync(&batch).unwrap(), 60);
        assert!(log.segment_count() > 5, "{}", log.segment_count());
        check_all(&mut log, 60);
        let window = log.read_after_sync(7, 40).unwrap();
        assert_eq!(window.len(), 40);
        assert!(window
            .iter()
            .enumerate()
            .all(|(i, r)| r.position == 8 + i as u64 && r.bytes == payload(7 + i)));
        drop(log);
        let mut log = SegmentLog::open_with(dir.path(), options).unwrap();
        check_all(&mut log, 60);
        // A single record larger than a segment still fits, alone.
        let big = vec![b'b'; 1000];
        assert_eq!(
            log.append_sync(Origin::Agent, Encoding::Json, &big)
                .unwrap(),
            61
        );
        assert_eq!(log.read_after_sync(60, 1).unwrap()[0].bytes, big);
    }

    #[test]
    fn damage_in_a_sealed_segment_is_corruption_even_at_its_end() {
        let (dir, options, log) = rolled_log();
        let first = &log.segments[0];
        let (path, len) = (first.path.clone(), first.len);
        drop(log);
        flip_byte(&path, len - 1);
        // Opening does not read sealed segments; the first read of it does.
        let mut log = SegmentLog::open_with(dir.path(), options).unwrap();
        assert_eq!(log.last_position_sync(), 30);
        let err = log.read_all_sync().unwrap_err();
        assert!(
            matches!(&err, LogError::Corrupt { detail, .. } if detail.contains("sealed segment")),
            "{err}"
        );
    }

    #[test]
    fn open_indexes_only_the_newest_segment_and_reads_the_rest_on_demand() {
        let (dir, options, log) = rolled_log();
        drop(log);
        let mut log = SegmentLog::open_with(dir.path(), options).unwrap();
        let sealed = log.segments.len() - 1;
        assert!(sealed > 1);
        assert!(log.segments[..sealed].iter().all(|s| s.unindexed.is_some()));
        assert_eq!(log.last_position_sync(), 30);
        // A read in the middle indexes just the segment it reaches.
        let middle = log.segments[1].first;
        let got = log.read_after_sync(middle - 1, 1).unwrap();
        assert_eq!(got[0].position, middle);
        assert!(log.segments[0].unindexed.is_some());
        assert!(log.segments[1].unindexed.is_none());
        check_all(&mut log, 30);
        // Appends continue after the newest record.
        let p = log
            .append_sync(Origin::Agent, encoding_of(30), &payload(30))
            .unwrap();
        assert_eq!(p, 31);
    }

    #[test]
    fn missing_segment_is_reported() {
        let (dir, options, log) = rolled_log();
        let middle = log.segments[1].path.clone();
        drop(log);
        fs::remove_file(middle).unwrap();
        let mut log = SegmentLog::open_with(dir.path(), options).unwrap();
        let err = log.read_all_sync().unwrap_err();
        assert!(
            matches!(&err, LogError::Corrupt { detail, .. } if detail.contains("missing")),
            "{err}"
        );
    }

    #[tokio::test]
    async fn event_log_trait_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = SegmentLog::open(dir.path()).unwrap();
        assert_eq!(EventLog::last_position(&mut log).await.unwrap(), 0);
        assert_eq!(
            log.append(Origin::Service, Encoding::Json, b"{}")
                .await
                .unwrap(),
            1
        );
        let batch = vec![(Origin::Agent, Encoding::Msgpack, vec![0x80]); 3];
        assert_eq!(log.append_batch(&batch).await.unwrap(), 4);
        let read = log.read_after(1, 10).await.unwrap();
        assert_eq!(read.len(), 3);
        assert_eq!(
            read[2],
            LogRecord::unaddressed(4, Origin::Agent, Encoding::Msgpack, vec![0x80])
        );
        assert_eq!(EventLog::last_position(&mut log).await.unwrap(), 4);
    }

    #[test]
    fn origins_survive_a_reopen_and_legacy_records_read_as_legacy() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = SegmentLog::open(dir.path()).unwrap();
        for origin in [Origin::Agent, Origin::Service, Origin::Legacy] {
            for encoding in [Encoding::Json, Encoding::Msgpack] {
                log.append_sync(origin, encoding, b"x").unwrap();
            }
        }
        drop(log);
        let mut log = SegmentLog::open(dir.path()).unwrap();
        let kinds: Vec<_> = log
            .read_all_sync()
            .unwrap()
            .into_iter()
            .map(|r| (r.origin, r.encoding))
            .collect();
        use Encoding::*;
        use Origin::*;
        assert_eq!(
            kinds,
            [
                (Agent, Json),
                (Agent, Msgpack),
                (Service, Json),
                (Service, Msgpack),
                (Legacy, Json),
                (Legacy, Msgpack)
            ]
        );
        // The bytes older builds wrote: 1 MessagePack, 2 JSON.
        assert_eq!(kind_byte(Legacy, Msgpack), 1);
        assert_eq!(kind_byte(Legacy, Json), 2);
        assert_eq!(kind_from_byte(7), None);
    }

    fn head_of(dir: &Path) -> Head {
        Head::decode(&fs::read(dir.join(HEAD_FILE)).unwrap()).unwrap()
    }

    #[test]
    fn damage_in_what_the_head_vouches_for_is_found_by_the_first_read() {
        let (dir, log) = filled(10);
        let path = newest_path(&log);
        let len_before = log.size_bytes();
        let offsets = log.segments[0].offsets.clone();
        drop(log);
        flip_byte(&path, offsets[2] + RECORD_OVERHEAD + 1);
        // Opening reads the head and its last record, not the rest.
        let mut log = SegmentLog::open(dir.path()).unwrap();
        assert_eq!(log.last_position_sync(), 10);
        assert_eq!(log.dropped_tail_bytes(), 0);
        let err = log.read_after_sync(8, 2).unwrap_err();
        match &err {
            LogError::Corrupt { offset, detail, .. } => {
                assert_eq!(*offset, offsets[2], "{err}");
                assert!(detail.contains("synced part"), "{err}");
            }
            other => panic!("expected Corrupt, got {other}"),
        }
        assert_eq!(fs::metadata(&path).unwrap().len(), len_before);
    }

    #[test]
    fn deferred_appends_are_read_from_memory_and_written_a_mebibyte_at_a_time() {
        let (dir, mut log) = filled(4);
        let path = newest_path(&log);
        let written = fs::metadata(&path).unwrap().len();
        for i in 4..10 {
            let pos = log
                .append_deferred(Origin::Agent, encoding_of(i), &payload(i))
                .unwrap();
            assert_eq!(pos, i as u64 + 1);
            // Readable at once, from memory: the file has not grown.
            let back = log.read_after_sync(pos - 1, 1).unwrap();
            assert_eq!(back[0].bytes, payload(i));
            assert_eq!(fs::metadata(&path).unwrap().len(), written);
        }
        assert_eq!(log.first_unwritten(), Some(5));
        // A read that takes written and unwritten records writes them first.
        check_all(&mut log, 10);
        assert_eq!(log.first_unwritten(), None);
        assert_eq!(fs::metadata(&path).unwrap().len(), log.size_bytes());
        // A mebibyte gathered is written without a sync.
        let big = vec![b'y'; UNWRITTEN_BYTES / 4];
        for _ in 0..4 {
            log.append_deferred(Origin::Agent, Encoding::Json, &big)
                .unwrap();
        }
        assert_eq!(log.first_unwritten(), None);
        assert_eq!(fs::metadata(&path).unwrap().len(), log.size_bytes());
        assert_eq!(head_of(dir.path()).records, 4, "not synced");
        // The next ones wait for the sync, which writes and syncs them.
        log.append_deferred(Origin::Agent, Encoding::Json, b"{}")
            .unwrap();
        assert_eq!(log.first_unwritten(), Some(15));
        log.sync_now().unwrap();
        assert_eq!(log.first_unwritten(), None);
        assert_eq!(head_of(dir.path()).records, 15);
        // Deferred appends a clean drop leaves are in the file; a kill
        // loses them (and never a record before them).
        log.append_deferred(Origin::Agent, Encoding::Json, b"[1]")
            .unwrap();
        drop(log);
        let mut log = SegmentLog::open(dir.path()).unwrap();
        assert_eq!(log.last_position_sync(), 16);
        log.append_deferred(Origin::Agent, Encoding::Json, b"[2]")
            .unwrap();
        log.unwritten.clear();
        drop(log);
        let mut log = SegmentLog::open(dir.path()).unwrap();
        assert_eq!(log.last_position_sync(), 16);
        let last = log.read_after_sync(15, 1).unwrap();
        assert_eq!(last[0].bytes, &b"[1]"[..]);
    }

    #[test]
    fn a_sync_beside_work_syncs_every_deferred_append_and_runs_the_work_here() {
        let (dir, mut log) = filled(3);
        let caller = std::thread::current().id();
        // Nothing to sync: the work runs, and the log is as it was.
        let (synced, ran_on) = log.sync_beside(|| std::thread::current().id());
        synced.unwrap();
        assert_eq!(ran_on, caller);
        for i in 3..8 {
            log.append_deferred(Origin::Agent, encoding_of(i), &payload(i))
                .unwrap();
        }
        assert_eq!(log.first_unwritten(), Some(4));
        assert_eq!(head_of(dir.path()).records, 3);
        let mut runs = 0;
        let (synced, ran_on) = log.sync_beside(|| {
            runs += 1;
            std::thread::current().id()
        });
        synced.unwrap();
        assert_eq!((runs, ran_on), (1, caller));
        // Written and synced, as `sync_now` leaves them.
        assert_eq!(log.first_unwritten(), None);
        assert!(!log.unsynced);
        assert_eq!(head_of(dir.path()).records, 8);
        drop(log);
        let mut log = SegmentLog::open(dir.path()).unwrap();
        check_all(&mut log, 8);
    }

    #[test]
    fn torn_tail_after_the_head_is_truncated_and_records_after_it_are_found() {
        let (dir, mut log) = filled(6);
        // Two records written after the last sync (the head says 6), then a
        // torn third one.
        for i in 6..8 {
            log.append_deferred(Origin::Agent, encoding_of(i), &payload(i))
                .unwrap();
        }
        let path = newest_path(&log);
        let clean_len = log.size_bytes();
        drop(log);
        assert_eq!(head_of(dir.path()).records, 6);
        let mut frame = Vec::new();
        frame_record(&mut frame, Origin::Agent, Encoding::Json, &[7u8; 300]);
        let mut f = OpenOptions::new().append(true).open(&path).unwrap();
        f.write_all(&frame[..150]).unwrap();
        drop(f);

        let mut log = SegmentLog::open(dir.path()).unwrap();
        assert_eq!(log.dropped_tail_bytes(), 150);
        assert_eq!(fs::metadata(&path).unwrap().len(), clean_len);
        assert_eq!(log.last_position_sync(), 8);
        let head = head_of(dir.path());
        assert_eq!((head.records, head.bytes), (8, clean_len));
        check_all(&mut log, 8);
        drop(log);
        let mut log = SegmentLog::open(dir.path()).unwrap();
        assert_eq!(log.dropped_tail_bytes(), 0);
        check_all(&mut log, 8);
    }

    #[test]
    fn an_unusable_head_is_ignored_and_the_newest_segment_scanned() {
        // Sealed segments, and a newest one of several records.
        let dir = tempfile::tempdir().unwrap();
        let options = SegmentOptions {
            segment_bytes: 500,
            ..SegmentOptions::default()
        };
        let mut log = SegmentLog::open_with(dir.path(), options).unwrap();
        fill(&mut log, 30);
        assert!(log.segment_count() > 2);
        let newest = &log.segments[log.segments.len() - 1];
        let good = Head {
            first: newest.first,
            records: newest.record_count(),
            bytes: newest.len,
            last_offset: newest.last_offset().unwrap(),
        };
        let path = newest.path.clone();
        assert!(newest.offsets.len() >= 2, "{:?}", newest.offsets);
        let second_last = newest.offsets[newest.offsets.len() - 2];
        drop(log);
        assert_eq!(head_of(dir.path()), good);
        let encoded = |h: Head| h.encode().to_vec();
        let mut bad_crc = good.encode().to_vec();
        bad_crc[10] ^= 1;
        let cases: Vec<(&str, Option<Vec<u8>>)> = vec![
            ("missing", None),
            ("empty", Some(Vec::new())),
            ("half written", Some(good.encode()[..20].to_vec())),
            ("garbage", Some(vec![0xAB; Head::LEN])),
            ("bad checksum", Some(bad_crc)),
            ("another segment", Some(encoded(Head { first: 1, ..good }))),
            (
                "longer than the file",
                Some(encoded(Head {
                    bytes: good.bytes + 1,
                    ..good
                })),
            ),
            (
                "last record elsewhere",
                Some(encoded(Head {
                    last_offset: second_last,
                    ..good
                })),
            ),
            (
                "last record not at a record",
                Some(encoded(Head {
                    last_offset: good.last_offset + 1,
                    ..good
                })),
            ),
            (
                "more records than bytes allow",
                Some(encoded(Head {
                    records: good.bytes,
                    ..good
                })),
            ),
        ];
        for (what, bytes) in cases {
            match &bytes {
                Some(b) => fs::write(dir.path().join(HEAD_FILE), b).unwrap(),
                None => fs::remove_file(dir.path().join(HEAD_FILE)).unwrap(),
            }
            let mut log = SegmentLog::open_with(dir.path(), options).unwrap();
            let newest = &log.segments[log.segments.len() - 1];
            assert!(newest.unindexed.is_none(), "{what}: scanned whole");
            assert_eq!(log.last_position_sync(), 30, "{what}");
            assert_eq!(log.dropped_tail_bytes(), 0, "{what}");
            check_all(&mut log, 30);
            drop(log);
            // Opening changed nothing; the next sync writes a good head.
            let after = fs::read(dir.path().join(HEAD_FILE)).ok();
            assert_eq!(after, bytes, "{what}: an open wrote the head");
            assert_eq!(fs::metadata(&path).unwrap().len(), good.bytes, "{what}");
        }
    }

    #[test]
    fn a_head_that_miscounts_its_records_is_caught_by_the_first_read() {
        let (dir, log) = filled(10);
        drop(log);
        let good = head_of(dir.path());
        let wrong = Head { records: 7, ..good };
        fs::write(dir.path().join(HEAD_FILE), wrong.encode()).unwrap();
        let mut log = SegmentLog::open(dir.path()).unwrap();
        let err = log.read_all_sync().unwrap_err();
        assert!(
            matches!(&err, LogError::Corrupt { detail, .. } if detail.contains("head file says")),
            "{err}"
        );
    }

    mod reopen {
        //! Whatever was appended, synced, lost in a crash or done to the
        //! head file, a log reopened with its head reads exactly what the
        //! same files scanned whole read.
        use super::*;
        use proptest::prelude::*;

        #[derive(Debug, Clone)]
        enum Step {
            Append(usize),
            Batch(Vec<usize>),
            Deferred(usize),
            Sync,
            Reopen,
            /// Drop the log, keep `keep` per mille of what the newest
            /// segment holds past its synced end, then `garbage` bytes.
            Crash {
                keep: u16,
                garbage: usize,
            },
            /// Save the head file now, to put it back later (a lost write).
            SaveHead,
            RestoreHead,
            DeleteHead,
            MangleHead(usize),
        }

        fn step() -> impl Strategy<Value = Step> {
            prop_oneof![
                4 => (0usize..120).prop_map(Step::Append),
                2 => proptest::collection::vec(0usize..120, 0..6).prop_map(Step::Batch),
                3 => (0usize..120).prop_map(Step::Deferred),
                1 => Just(Step::Sync),
                2 => Just(Step::Reopen),
                2 => (0u16..=1000, 0usize..40).prop_map(|(keep, garbage)| Step::Crash { keep, garbage }),
                1 => Just(Step::SaveHead),
                1 => Just(Step::RestoreHead),
                1 => Just(Step::DeleteHead),
                1 => (0usize..Head::LEN).prop_map(Step::MangleHead),
            ]
        }

        fn bytes_of(i: usize, size: usize) -> Vec<u8> {
            (0..size).map(|j| (i * 31 + j) as u8).collect()
        }

        /// Opens `dir` as it is and, in a copy without its head file,
        /// scanned whole; both must agree. Returns the first.
        fn open_and_compare(dir: &Path, options: SegmentOptions) -> SegmentLog {
            let copy = tempfile::tempdir().unwrap();
            for entry in fs::read_dir(dir).unwrap() {
                let entry = entry.unwrap();
                let name = entry.file_name();
                if name != HEAD_FILE && name != LOCK_FILE {
                    fs::copy(entry.path(), copy.path().join(&name)).unwrap();
                }
            }
            let mut scanned = SegmentLog::open_with(copy.path(), options).unwrap();
            let mut log = SegmentLog::open_with(dir, options).unwrap();
            assert_eq!(log.last_position_sync(), scanned.last_position_sync());
            assert_eq!(log.dropped_tail_bytes(), scanned.dropped_tail_bytes());
            assert_eq!(log.size_bytes(), scanned.size_bytes());
            assert_eq!(
                log.read_all_sync().unwrap(),
                scanned.read_all_sync().unwrap()
            );
            log
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(64))]
            #[test]
            fn reopening_with_the_head_reads_what_a_full_scan_reads(
                steps in proptest::collection::vec(step(), 1..40),
            ) {
                let dir = tempfile::tempdir().unwrap();
                let options = SegmentOptions { segment_bytes: 400, ..SegmentOptions::default() };
                let mut log = SegmentLog::open_with(dir.path(), options).unwrap();
                // Every record appended, in order; those up to `durable`
                // were synced and must survive anything.
                let mut model: Vec<Vec<u8>> = Vec::new();
                // Deferred records since the last sync (a roll syncs too).
                let mut pending = 0usize;
                let mut saved_head: Option<Vec<u8>> = None;
                let head_path = dir.path().join(HEAD_FILE);
                for (i, step) in steps.into_iter().enumerate() {
                    match step {
                        Step::Append(n) => {
                            pending = 0;
                            model.push(bytes_of(i, n));
                            log.append_sync(Origin::Agent, Encoding::Msgpack, &bytes_of(i, n)).unwrap();
                        }
                        Step::Batch(sizes) => {
                            let batch: Vec<_> = sizes.iter().enumerate()
                                .map(|(k, &n)| (Origin::Service, Encoding::Json, bytes_of(i * 7 + k, n)))
                                .collect();
                            model.extend(batch.iter().map(|b| b.2.clone()));
                            log.append_batch_sync(&batch).unwrap();
                            if !batch.is_empty() {
                                pending = 0;
                            }
                        }
                        Step::Deferred(n) => {
                            model.push(bytes_of(i, n));
                            let segments = log.segment_count();
                            log.append_deferred(Origin::Agent, Encoding::Msgpack, &bytes_of(i, n)).unwrap();
                            if log.segment_count() != segments {
                                pending = 0;
                            }
                            pending += 1;
                        }
                        Step::Sync => {
                            pending = 0;
                            log.sync_now().unwrap();
                        }
                        Step::Reopen => {
                            pending = 0;
                            log.sync_now().unwrap();
                            drop(log);
                            log = open_and_compare(dir.path(), options);
                        }
                        Step::Crash { keep, garbage } => {
                            let newest = &log.segments[log.segments.len() - 1];
                            let (path, len) = (newest.path.clone(), newest.len);
                            // Deferred records sit at the end of the
                            // newest segment (a roll syncs first), after
                            // its synced part.
                            let durable = model.len() - pending;
                            let synced = if pending > 0 {
                                newest.offsets[newest.offsets.len() - pending]
                            } else {
                                len
                            };
                            // Half the crashes are kills: the deferred
                            // appends still in memory never reach the file.
                            if keep % 2 == 1 {
                                log.unwritten.clear();
                            }
                            drop(log);
                            let len = fs::metadata(&path).unwrap().len();
                            let synced = synced.min(len);
                            let cut = synced + (len - synced) * u64::from(keep) / 1000;
                            let f = OpenOptions::new().write(true).open(&path).unwrap();
                            f.set_len(cut).unwrap();
                            drop(f);
                            let mut f = OpenOptions::new().append(true).open(&path).unwrap();
                            f.write_all(&vec![0x5A; garbage]).unwrap();
                            drop(f);
                            log = open_and_compare(dir.path(), options);
                            let n = log.last_position_sync() as usize;
                            prop_assert!(n >= durable && n <= model.len(), "{n} of {} ({durable} durable)", model.len());
                            model.truncate(n);
                            pending = 0;
                        }
                        Step::SaveHead => saved_head = fs::read(&head_path).ok(),
                        Step::RestoreHead => {
                            if let Some(h) = &saved_head {
                                fs::write(&head_path, h).unwrap();
                            }
                        }
                        Step::DeleteHead => {
                            let _ = fs::remove_file(&head_path);
                        }
                        Step::MangleHead(at) => {
                            if let Ok(mut h) = fs::read(&head_path) {
                                if let Some(b) = h.get_mut(at) {
                                    *b ^= 0x10;
                                }
                                fs::write(&head_path, h).unwrap();
                            }
                        }
                    }
                }
                log.sync_now().unwrap();
                drop(log);
                let mut log = open_and_compare(dir.path(), options);
                let read: Vec<Vec<u8>> = log.read_all_sync().unwrap().into_iter().map(|r| r.bytes.to_vec()).collect();
                prop_assert_eq!(read, model);
            }
        }
    }
}
