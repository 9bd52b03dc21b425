//! The `contextfold` command: the binary's edge (anyhow errors, clap).

mod cli;

use clap::Parser;

/// jemalloc rather than glibc's malloc: `run` allocates a turn's readings
/// on its measuring thread and frees them on the fold's, and the folder
/// allocates and frees every message; on the real-transcript fleet `run`
/// needs ~11% less CPU with it (`docs/notes/issue-26.md`, fifth pass) for
/// ~8% more peak RSS (mimalloc was as fast but held ~38% more), and frees
/// on one thread what another allocated without waiting on its arena.
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> std::process::ExitCode {
    let args = cli::Cli::parse();
    // Logging starts once the configuration (`[log] format`) is read.
    match cli::run(args) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {}", chain(&err));
            std::process::ExitCode::FAILURE
        }
    }
}

/// The error and its causes, `: `-separated, as `{err:#}` prints them but
/// without a cause the message before it already ends with: the library's
/// errors name their cause in their own message (so a log line with `%e`
/// has it) and keep it as their `#[source]` too.
fn chain(err: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in err.chain() {
        let text = cause.to_string();
        if out.ends_with(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::chain;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot open the store: {source}")]
    struct Open {
        #[source]
        source: std::io::Error,
    }

    #[test]
    fn a_cause_the_message_already_names_is_printed_once() {
        let io = std::io::Error::other("disk full");
        let err = anyhow::Error::new(Open { source: io }).context("starting serve");
        assert_eq!(
            chain(&err),
            "starting serve: cannot open the store: disk full"
        );
        let plain = anyhow::anyhow!("inner").context("outer");
        assert_eq!(chain(&plain), "outer: inner");
    }
}
