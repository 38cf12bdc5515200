//! The Python OTLP receiver (`tests/otlp_receiver.py`, run with `<repo>/.venv/bin/python`)
//! as a child process, for every crate's trace tests: they include this file with
//! `#[path = ".../reach-telemetry/tests/support/otlp.rs"] mod otlp;` rather than copy it.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// A running receiver: spans exported to [`OtlpReceiver::endpoint`] land, one JSON object a
/// line, in a temporary file that [`OtlpReceiver::spans`] reads.
pub struct OtlpReceiver {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
    out: PathBuf,
}

impl OtlpReceiver {
    /// Starts a receiver; `blackhole` makes it accept exports and never answer. `repo_root`
    /// is the repository root (where `.venv` is).
    pub fn start(repo_root: &Path, blackhole: bool) -> Self {
        let python = repo_root.join(".venv/bin/python");
        assert!(
            python.exists(),
            "{} is missing: run scripts/python-env.sh at the repository root",
            python.display()
        );
        static STARTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let out =
            std::env::temp_dir().join(format!("reach-spans-{}-{n}.jsonl", std::process::id()));
        let mut command = Command::new(python);
        command
            .arg(repo_root.join("sdk/rust/reach-telemetry/tests/otlp_receiver.py"))
            .args(["--port", "0", "--out"])
            .arg(&out)
            .stdout(Stdio::piped());
        if blackhole {
            command.arg("--blackhole");
        }
        let mut child = command.spawn().expect("start the OTLP receiver");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port = line
            .trim()
            .strip_prefix("PORT ")
            .unwrap_or_else(|| panic!("the receiver printed {line:?}"))
            .to_string();
        Self {
            child,
            endpoint: format!("http://127.0.0.1:{port}"),
            out,
        }
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(&self.out)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.out);
    }
}
