//! What a process has used, as Linux's `/proc` says it: the benchmark reads
//! the relay's, a replay reports its own.

/// The peak resident memory of process `pid` (`"self"` for this one), in
/// MiB; `None` where `/proc` does not say it.
pub(crate) fn peak_memory_mib(pid: &str) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|line| line.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}
