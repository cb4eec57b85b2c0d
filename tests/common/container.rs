//! The relay's container image, run by a container engine as a user runs
//! it, for the tests of the image (`tests/image`).
//!
//! `OUTBOX_IMAGE` names the image (`outbox-relay:latest`, which
//! `scripts/image.sh` tags); `OUTBOX_CONTAINER_ENGINE` the engine's command
//! (podman, with runc where it is installed, as `scripts/image.sh` chooses).

use std::process::Command;

/// The image, and the engine that runs it.
pub struct Image {
    engine: Vec<String>,
    name: String,
}

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
        let found = image
            .engine()
            .args(["image", "inspect", &image.name])
            .output();
        assert!(
            found.is_ok_and(|output| output.status.success()),
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

    /// `relay` (the relay's binary with its arguments and settings) as a
    /// container of the image named `container`: on the host's network,
    /// with a read-only root, no capabilities and no way to gain any, as
    /// the manifests in `deploy/` run it.
    pub fn run(&self, relay: &Command, container: &str) -> Command {
        let mut command = self.engine();
        command.args(["run", "--rm", "--name", container, "--network", "host"]);
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
        let sent = self
            .engine()
            .args(["kill", "--signal", signal, container])
            .output();
        assert!(
            sent.is_ok_and(|output| output.status.success()),
            "send SIG{signal} to container {container}"
        );
    }

    /// Kills and removes `container`, running or not, there or not.
    pub fn remove(&self, container: &str) {
        let _ = self
            .engine()
            .args(["kill", "--signal", "KILL", container])
            .output();
        let _ = self.engine().args(["rm", "--force", container]).output();
    }

    /// The host's process id of the relay in `container`.
    pub fn host_pid(&self, container: &str) -> u32 {
        let output = self
            .engine()
            .args(["inspect", "--format", "{{.State.Pid}}", container])
            .output()
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
