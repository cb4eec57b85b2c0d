//! The relay's container image, run by a container engine as a user runs
//! it, for the tests of the image (`tests/image`).
//!
//! `OUTBOX_IMAGE` names the image (`outbox-relay:latest`, which
//! `scripts/image.sh` tags); `OUTBOX_CONTAINER_ENGINE` the engine's command
//! (podman, with runc where it is installed, as `scripts/image.sh` chooses).

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::Once;
use std::time::{Duration, Instant};

/// The image, and the engine that runs it.
pub struct Image {
    engine: Vec<String>,
    name: String,
}

/// Marks the containers the tests start with the test process's id, so
/// that a run's leftovers (a test binary killed before its cleanup) are
/// removed by the next, and another run's live ones are not.
const LABEL: &str = "outbox-relay-test";

/// How long an engine command other than a container's run may take.
const ENGINE_WAIT: Duration = Duration::from_secs(60);

impl Image {
    pub fn from_env() -> Self {
        let engine = match std::env::var("OUTBOX_CONTAINER_ENGINE") {
            Ok(engine) => engine.split_whitespace().map(str::to_owned).collect(),
            // crun refuses some hosts' hybrid cgroups; runc, where present, does not.
            Err(_) if on_path("runc") => {
                vec!["podman".into(), "--runtime".into(), "runc".into()]
            }
            Err(_) => vec!["podman".into()],
        };
        let name = std::env::var("OUTBOX_IMAGE").unwrap_or_else(|_| "outbox-relay:latest".into());
        let image = Image { engine, name };
        static LEFTOVERS: Once = Once::new();
        LEFTOVERS.call_once(|| image.remove_leftovers());
        let found = image.finish(["image", "inspect", &image.name]);
        assert!(
            found.is_some_and(|output| output.status.success()),
            "no image {} for {:?}: build it with scripts/image.sh --offline",
            image.name,
            image.engine
        );
        image
    }

    fn engine(&self) -> Command {
        let mut command = Command::new(&self.engine[0]);
        command.args(&self.engine[1..]);
        command
    }

    /// Runs an engine command to its end, within [`ENGINE_WAIT`] (none if
    /// it could not start or took longer, and was killed). Its output is
    /// read as it comes, so a long listing cannot fill a pipe and stall it.
    fn finish<'a>(&self, args: impl IntoIterator<Item = &'a str>) -> Option<Output> {
        let mut child = self
            .engine()
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .ok()?;
        let stdout = drain(child.stdout.take());
        let stderr = drain(child.stderr.take());
        let deadline = Instant::now() + ENGINE_WAIT;
        let status = loop {
            if let Some(status) = child.try_wait().ok()? {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        // A process the engine left behind may hold a pipe open: that
        // pipe's output is then given up after a second.
        let read = |pipe: std::sync::mpsc::Receiver<Vec<u8>>| {
            pipe.recv_timeout(Duration::from_secs(1))
                .unwrap_or_default()
        };
        Some(Output {
            status,
            stdout: read(stdout),
            stderr: read(stderr),
        })
    }

    /// Removes the containers a run of the tests that has ended left.
    fn remove_leftovers(&self) {
        let filter = format!("label={LABEL}");
        let format = format!("{{{{.ID}}}} {{{{index .Labels \"{LABEL}\"}}}}");
        let listed = self.finish(["ps", "--all", "--filter", &filter, "--format", &format]);
        let listed = listed.map(|output| String::from_utf8_lossy(&output.stdout).into_owned());
        for line in listed.iter().flat_map(|listed| listed.lines()) {
            let Some((id, owner)) = line.split_once(' ') else {
                continue;
            };
            if !PathBuf::from(format!("/proc/{}", owner.trim())).exists() {
                self.remove(id);
            }
        }
    }

    /// `relay` (the relay's binary with its arguments and settings) as a
    /// container of the image named `container`: on the host's network,
    /// with a read-only root, no capabilities and no way to gain any, as
    /// the manifests in `deploy/` run it.
    pub fn run(&self, relay: &Command, container: &str) -> Command {
        let mut command = self.engine();
        let label = format!("{LABEL}={}", std::process::id());
        command.args(["run", "--rm", "--name", container, "--label", &label]);
        command.args(["--network", "host"]);
        command.args(["--read-only", "--cap-drop", "ALL"]);
        command.args(["--security-opt", "no-new-privileges"]);
        // Containers on some hosts may not raise their resource limits
        // past the engine's own, and the engine's defaults are above them:
        // limits under both are given, ample for a relay (a few dozen
        // threads and descriptors).
        for (limit, name) in [("Max open files", "nofile"), ("Max processes", "nproc")] {
            let most = soft_limit(limit).unwrap_or(u64::MAX).min(4096);
            command.args(["--ulimit", &format!("{name}={most}:{most}")]);
        }
        for (key, value) in relay.get_envs() {
            if let Some(value) = value {
                let setting = format!("{}={}", key.to_string_lossy(), value.to_string_lossy());
                command.args(["--env", &setting]);
            }
        }
        command.arg(&self.name).args(relay.get_args());
        command
    }

    /// Sends `signal` (`TERM`, `KILL`) to the relay in `container`.
    pub fn signal(&self, container: &str, signal: &str) {
        let sent = self.finish(["kill", "--signal", signal, container]);
        assert!(
            sent.is_some_and(|output| output.status.success()),
            "send SIG{signal} to container {container}"
        );
    }

    /// Kills and removes `container`, running or not, there or not.
    pub fn remove(&self, container: &str) {
        self.finish(["kill", "--signal", "KILL", container]);
        self.finish(["rm", "--force", container]);
    }

    /// The host's process id of the relay in `container`.
    pub fn host_pid(&self, container: &str) -> u32 {
        let output = self
            .finish(["inspect", "--format", "{{.State.Pid}}", container])
            .expect("inspect the container");
        String::from_utf8_lossy(&output.stdout)
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("container {container} has no process: {output:?}"))
    }
}

/// This process's soft limit named `limit` in `/proc/self/limits`; none
/// where it is unlimited.
fn soft_limit(limit: &str) -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").expect("read /proc/self/limits");
    let soft = limits
        .lines()
        .find_map(|line| line.strip_prefix(limit))
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no {limit:?} in /proc/self/limits"));
    soft.parse().ok()
}

/// Whether `tool` is a file in one of `PATH`'s folders.
fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(tool).is_file()))
}

/// Reads a pipe to its end on a thread of its own; the receiver gets what
/// it read.
fn drain(pipe: Option<impl Read + Send + 'static>) -> std::sync::mpsc::Receiver<Vec<u8>> {
    let (sender, read) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_end(&mut bytes);
        }
        let _ = sender.send(bytes);
    });
    read
}
