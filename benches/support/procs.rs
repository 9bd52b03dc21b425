//! Shared by the process-level benches (`fleet_memory`, `takeover`): which
//! `contextfold` binaries to compare, running one as a child and measuring
//! exactly that child (wait4: peak resident memory and wall time), disk
//! checks and sizes, a seeded generator and a side-by-side table.
//!
//! Binaries come from `CONTEXTFOLD_BENCH_BINS`
//! (`before=/path/a,after=/path/b`, or one bare path); default: the
//! `contextfold` binary cargo built with the bench.

use std::ffi::OsStr;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// One binary under test: its label in the tables and its path.
#[derive(Debug, Clone)]
pub struct Bin {
    pub label: String,
    pub path: PathBuf,
}

/// The binaries named by `CONTEXTFOLD_BENCH_BINS`, checked to exist.
pub fn bins() -> Result<Vec<Bin>, String> {
    let spec = std::env::var("CONTEXTFOLD_BENCH_BINS").unwrap_or_default();
    let mut out = Vec::new();
    if spec.trim().is_empty() {
        out.push(Bin {
            label: "this".into(),
            path: PathBuf::from(env!("CARGO_BIN_EXE_contextfold")),
        });
    } else {
        for (i, item) in spec.split(',').filter(|s| !s.trim().is_empty()).enumerate() {
            let (label, path) = match item.split_once('=') {
                Some((l, p)) => (l.trim().to_string(), p.trim()),
                None => (format!("bin{}", i + 1), item.trim()),
            };
            out.push(Bin {
                label,
                path: PathBuf::from(path),
            });
        }
    }
    for b in &out {
        if !b.path.is_file() {
            return Err(format!(
                "{}: no binary at {} (CONTEXTFOLD_BENCH_BINS=label=path,label=path; build it \
                 with `cargo build --release --bin contextfold`)",
                b.label,
                b.path.display()
            ));
        }
    }
    Ok(out)
}

/// A command for `bin` whose environment holds no bench knob: the binary
/// refuses `CONTEXTFOLD_*` variables that are not configuration keys, and
/// the benches' own (`CONTEXTFOLD_FLEET_*`, `CONTEXTFOLD_TAKEOVER_*`) are not.
pub fn command(bin: &Bin) -> Command {
    let mut c = Command::new(&bin.path);
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy().into_owned();
        if k.starts_with("CONTEXTFOLD_FLEET_") || k.starts_with("CONTEXTFOLD_TAKEOVER_") {
            c.env_remove(&k);
        }
    }
    c.stdin(Stdio::null());
    c
}

/// What wait4 reported for one child.
#[derive(Debug, Clone, Copy)]
pub struct Measured {
    pub wall: Duration,
    /// Peak resident set of that child alone (ru_maxrss), bytes.
    pub peak_rss: u64,
    pub user: Duration,
    pub sys: Duration,
    pub success: bool,
}

/// Runs `cmd` to its end (stdout and stderr to `out` and `err`, `None`:
/// discarded) and measures that child with wait4.
pub fn measure(
    mut cmd: Command,
    out: Option<&Path>,
    err: Option<&Path>,
) -> Result<Measured, String> {
    let sink = |p: Option<&Path>| -> Result<Stdio, String> {
        match p {
            Some(p) => std::fs::File::create(p)
                .map(Stdio::from)
                .map_err(|e| format!("creating {}: {e}", p.display())),
            None => Ok(Stdio::null()),
        }
    };
    cmd.stdout(sink(out)?).stderr(sink(err)?);
    let started = Instant::now();
    let child = cmd
        .spawn()
        .map_err(|e| format!("spawning {:?}: {e}", cmd.get_program()))?;
    let (status, usage) = wait4(child.id())?;
    let wall = started.elapsed();
    Ok(Measured {
        wall,
        peak_rss: (usage.ru_maxrss.max(0) as u64) * 1024,
        user: timeval(usage.ru_utime),
        sys: timeval(usage.ru_stime),
        success: libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
    })
}

/// Reaps child `pid` (blocking) with its own resource usage.
pub fn wait4(pid: u32) -> Result<(i32, libc::rusage), String> {
    let mut status: libc::c_int = 0;
    // SAFETY: rusage is plain old data; wait4 fills it for the child `pid`,
    // which this process spawned and has not reaped.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: valid pointers to locals; pid is our own child.
        let r = unsafe { libc::wait4(pid as libc::pid_t, &mut status, 0, &mut usage) };
        if r == pid as libc::pid_t {
            return Ok((status, usage));
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(format!("wait4({pid}): {e}"));
        }
    }
}

fn timeval(t: libc::timeval) -> Duration {
    Duration::from_secs(t.tv_sec.max(0) as u64) + Duration::from_micros(t.tv_usec.max(0) as u64)
}

/// Free bytes on the file system holding `dir`.
pub fn free_bytes(dir: &Path) -> Result<u64, String> {
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes())
        .map_err(|e| format!("{}: {e}", dir.display()))?;
    // SAFETY: statvfs is plain old data filled by the call.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid C string and pointer.
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return Err(format!(
            "statvfs {}: {}",
            dir.display(),
            std::io::Error::last_os_error()
        ));
    }
    Ok(s.f_bavail as u64 * s.f_frsize as u64)
}

/// Bytes a file or directory tree takes on disk (allocated blocks, as `du`).
pub fn disk_usage(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return 0;
    };
    let mut total = meta.blocks() * 512;
    if meta.is_dir() {
        if let Ok(entries) = std::fs::read_dir(path) {
            for e in entries.flatten() {
                total += disk_usage(&e.path());
            }
        }
    }
    total
}

/// The bench's scratch directory: `CONTEXTFOLD_BENCH_DIR` or the system's
/// temp directory, a fresh subdirectory removed on drop.
pub fn scratch(stem: &str) -> Result<tempfile::TempDir, String> {
    let base = std::env::var_os("CONTEXTFOLD_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    std::fs::create_dir_all(&base).map_err(|e| format!("creating {}: {e}", base.display()))?;
    tempfile::Builder::new()
        .prefix(stem)
        .tempdir_in(&base)
        .map_err(|e| format!("temp dir in {}: {e}", base.display()))
}

/// Refuses to start when `dir`'s file system has less than `need` bytes free.
pub fn require_free(dir: &Path, need: u64, what: &str) -> Result<(), String> {
    let free = free_bytes(dir)?;
    if free < need {
        return Err(format!(
            "not enough disk in {}: {what} needs about {}, {} free; set CONTEXTFOLD_BENCH_DIR \
             to a larger file system or lower the scale",
            dir.display(),
            mib(need),
            mib(free)
        ));
    }
    Ok(())
}

/// A float knob from the environment.
pub fn env_f64(name: &str, default: f64) -> Result<f64, String> {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .map_err(|e| format!("{name}={v:?}: not a number ({e})")),
        Err(_) => Ok(default),
    }
}

/// An integer knob from the environment.
pub fn env_u64(name: &str, default: u64) -> Result<u64, String> {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .replace('_', "")
            .parse()
            .map_err(|e| format!("{name}={v:?}: not a whole number ({e})")),
        Err(_) => Ok(default),
    }
}

/// xorshift64*: deterministic, seeded, no dependency.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }
}

pub fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

pub fn secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s < 1.0 {
        format!("{:.0} ms", s * 1000.0)
    } else {
        format!("{s:.2} s")
    }
}

/// Minimum and median of some durations ("-" when empty).
pub fn min_median(v: &[Duration]) -> String {
    if v.is_empty() {
        return "-".into();
    }
    let mut v = v.to_vec();
    v.sort();
    format!("{} / {}", secs(v[0]), secs(v[v.len() / 2]))
}

/// Minimum and median of some byte counts.
pub fn min_median_bytes(v: &[u64]) -> String {
    if v.is_empty() {
        return "-".into();
    }
    let mut v = v.to_vec();
    v.sort();
    format!("{} / {}", mib(v[0]), mib(v[v.len() / 2]))
}

/// A table: rows = measurements, columns = binaries.
#[derive(Debug, Default)]
pub struct Table {
    columns: Vec<String>,
    rows: Vec<(String, Vec<String>)>,
}

impl Table {
    pub fn new(columns: impl IntoIterator<Item = impl Into<String>>) -> Table {
        Table {
            columns: columns.into_iter().map(Into::into).collect(),
            rows: Vec::new(),
        }
    }

    /// Sets cell (`row`, column `col`), adding the row when new.
    pub fn set(&mut self, row: &str, col: usize, value: impl Into<String>) {
        let n = self.columns.len();
        let idx = match self.rows.iter().position(|(r, _)| r == row) {
            Some(i) => i,
            None => {
                self.rows.push((row.to_string(), vec!["-".into(); n]));
                self.rows.len() - 1
            }
        };
        if let Some(cell) = self.rows[idx].1.get_mut(col) {
            *cell = value.into();
        }
    }

    pub fn render(&self) -> String {
        let w0 = self
            .rows
            .iter()
            .map(|(r, _)| r.len())
            .max()
            .unwrap_or(0)
            .max(11);
        let widths: Vec<usize> = (0..self.columns.len())
            .map(|c| {
                self.rows
                    .iter()
                    .map(|(_, v)| v[c].len())
                    .chain([self.columns[c].len()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut s = String::new();
        let _ = write!(s, "{:<w0$}", "measurement");
        for (c, w) in self.columns.iter().zip(&widths) {
            let _ = write!(s, " | {c:>w$}");
        }
        s.push('\n');
        let _ = write!(s, "{}", "-".repeat(w0));
        for w in &widths {
            let _ = write!(s, "-+-{}", "-".repeat(*w));
        }
        s.push('\n');
        for (r, vals) in &self.rows {
            let _ = write!(s, "{r:<w0$}");
            for (v, w) in vals.iter().zip(&widths) {
                let _ = write!(s, " | {v:>w$}");
            }
            s.push('\n');
        }
        s
    }
}

/// `bin --version`, for the header of a run.
pub fn version(bin: &Bin) -> String {
    command(bin)
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|e| format!("(cannot run: {e})"))
}

/// Arguments as one printable line.
pub fn shown(args: &[&OsStr]) -> String {
    args.iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}
