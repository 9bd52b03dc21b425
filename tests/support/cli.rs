//! The `contextfold` binary as the tests run it: under a data directory of
//! their own, with nothing of the caller's configuration.

use std::path::Path;
use std::process::{Command, Output};

/// `contextfold --data DATA ARGS...`, not yet run.
pub fn command(data: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_contextfold"));
    cmd.arg("--data")
        .arg(data)
        .args(args)
        .env_remove("CONTEXTFOLD_CONFIG");
    cmd
}

/// (success, stdout, stderr) of a finished run.
pub fn split(out: Output) -> (bool, String, String) {
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs `contextfold --data DATA ARGS...` to the end.
pub fn run(data: &Path, args: &[&str]) -> (bool, String, String) {
    split(
        command(data, args)
            .output()
            .expect("the contextfold binary runs"),
    )
}

/// Parses a command's JSON output, naming it when it is not JSON.
pub fn json_of(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}
