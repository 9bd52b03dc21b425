//! Golden files: what a test produced, compared with what is committed.
//! `CONTEXTFOLD_BLESS=1` writes the file instead (review the diff).

use std::path::Path;

/// Compares `actual` with the golden file at `path`; with
/// `CONTEXTFOLD_BLESS=1` writes it instead. `what` says what a difference
/// means and `rerun` how to bless it (`cargo test --test api`).
pub fn check(path: &Path, actual: &str, what: &str, rerun: &str) {
    if std::env::var_os("CONTEXTFOLD_BLESS").is_some_and(|v| v == "1") {
        if let Some(dir) = path.parent() {
            if let Err(e) = std::fs::create_dir_all(dir) {
                panic!("cannot create {}: {e}", dir.display());
            }
        }
        if let Err(e) = std::fs::write(path, actual) {
            panic!("cannot write {}: {e}", path.display());
        }
        return;
    }
    let expected = match std::fs::read_to_string(path) {
        Ok(s) => s,
        Err(e) => panic!(
            "cannot read {}: {e}; run `CONTEXTFOLD_BLESS=1 {rerun}` to write it",
            path.display()
        ),
    };
    if expected != actual {
        let line = expected
            .lines()
            .zip(actual.lines())
            .position(|(a, b)| a != b)
            .map_or_else(
                || expected.lines().count().min(actual.lines().count()) + 1,
                |i| i + 1,
            );
        panic!(
            "{} differs from the golden file at line {line}. {what} If that is intended, \
             rerun with `CONTEXTFOLD_BLESS=1 {rerun}` and review the diff.\n\
             expected: {:?}\nactual:   {:?}",
            path.display(),
            expected.lines().nth(line - 1).unwrap_or(""),
            actual.lines().nth(line - 1).unwrap_or(""),
        );
    }
}
