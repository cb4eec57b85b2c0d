//! The deployment files say what the relay takes: the Kubernetes
//! ConfigMap's config file is one the relay accepts, and the Deployment's
//! user and port are the image's. (Their schemas are checked by
//! scripts/validate-deploy.sh.)

use std::path::PathBuf;

use crate::cli::{assert_exits_saying, ConfigFile};

fn deploy(path: &str) -> String {
    let file = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()))
}

/// The config file embedded in the ConfigMap (`relay.toml: |`).
fn config_file() -> String {
    let configmap = deploy("deploy/kubernetes/configmap.yaml");
    let (_, body) = configmap
        .split_once("relay.toml: |\n")
        .expect("the ConfigMap holds relay.toml");
    body.lines()
        .map(|line| line.strip_prefix("    ").unwrap_or(line))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn the_configmaps_config_file_is_one_the_relay_accepts() {
    let file = ConfigFile::new("configmap", &config_file());
    let path = file.0.to_str().expect("a UTF-8 path");
    // Nothing listens on port 1: past its settings, the relay stops at its
    // first check, unable to reach MongoDB (exit 3), not at a setting (2).
    let uri = "mongodb://127.0.0.1:1/?serverSelectionTimeoutMS=500";
    let args = ["run", "--config", path, "--mongodb-uri", uri];
    assert_exits_saying(&args, 3, &["cannot reach MongoDB"]);
}

#[test]
fn the_deployment_runs_as_the_images_user_on_its_port() {
    let dockerfile = deploy("Dockerfile");
    assert!(dockerfile.contains("USER 65532:65532"));
    assert!(dockerfile.contains("OUTBOX_METRICS_ADDR=0.0.0.0:9464"));
    for manifest in ["deployment.yaml", "sidecar.yaml"] {
        let text = deploy(&format!("deploy/kubernetes/{manifest}"));
        assert!(text.contains("runAsUser: 65532"), "{manifest}");
        assert!(text.contains("containerPort: 9464"), "{manifest}");
        assert!(text.contains("readOnlyRootFilesystem: true"), "{manifest}");
    }
}

/// One alert rule as `deploy/prometheus/alerts.yaml` writes it.
#[derive(Debug, Default)]
struct Rule {
    name: String,
    expr: String,
    pending: Option<u64>,
    summary: String,
}

/// Minutes in a Prometheus duration such as `15m` or `1h`; `None` for
/// any other shape.
fn minutes(duration: &str) -> Option<u64> {
    let (number, unit) = duration.split_at(duration.find(|c: char| !c.is_ascii_digit())?);
    let number: u64 = number.parse().ok()?;
    match unit {
        "m" => Some(number),
        "h" => Some(number * 60),
        _ => None,
    }
}

/// The rules, read line by line: each `- alert:` starts one, and its
/// expression, `for:` and annotations follow it.
fn rules() -> Vec<Rule> {
    let text = deploy("deploy/prometheus/alerts.yaml");
    let mut rules: Vec<Rule> = Vec::new();
    let mut in_expr = false;
    for line in text.lines() {
        let trimmed = line.trim();
        if let Some(name) = trimmed.strip_prefix("- alert: ") {
            rules.push(Rule {
                name: name.to_owned(),
                ..Rule::default()
            });
            continue;
        }
        let Some(rule) = rules.last_mut() else {
            continue;
        };
        if let Some(expr) = trimmed.strip_prefix("expr: ") {
            in_expr = expr == ">-";
            rule.expr.push_str(expr.trim_start_matches(">-"));
        } else if let Some(pending) = trimmed.strip_prefix("for: ") {
            in_expr = false;
            rule.pending = minutes(pending);
        } else if let Some(summary) = trimmed.strip_prefix("summary: ") {
            in_expr = false;
            rule.summary = summary.to_owned();
        } else if trimmed.contains(": ") || trimmed.ends_with(':') {
            in_expr = false;
        } else if in_expr {
            rule.expr.push(' ');
            rule.expr.push_str(trimmed);
        }
    }
    rules
}

/// Every "N minutes" an alert's summary states is a span
/// its rule has: a range of its expression (`[Nm]`), its `for:`, or a
/// threshold in seconds on an age plus its `for:` (the time from the last
/// event until the alert fires).
#[test]
fn each_alerts_stated_minutes_are_its_rules() {
    let rules = rules();
    assert!(rules.len() >= 15, "{} rules read", rules.len());
    for rule in &rules {
        let words: Vec<&str> = rule.summary.split_whitespace().collect();
        let stated = words
            .windows(2)
            .filter(|pair| pair[1].trim_end_matches([',', '.', ';', ')', '"']) == "minutes")
            .filter_map(|pair| pair[0].parse::<u64>().ok());
        let thresholds: Vec<u64> = rule
            .expr
            .split("> ")
            .skip(1)
            .filter_map(|rest| rest.split_whitespace().next()?.parse().ok())
            .collect();
        // A threshold of a minute or more is on an age: the alert fires
        // that long after the last event, and its `for:` later.
        let aged: Vec<u64> = thresholds
            .iter()
            .filter(|seconds| **seconds >= 60 && **seconds % 60 == 0)
            .map(|seconds| seconds / 60 + rule.pending.unwrap_or(0))
            .collect();
        for minutes in stated {
            let ranged = rule.expr.contains(&format!("[{minutes}m]"));
            let pending = rule.pending == Some(minutes);
            let fits = if aged.is_empty() {
                ranged || pending
            } else {
                aged.contains(&minutes)
            };
            assert!(
                fits,
                "{}: says {minutes} minutes, which its rule has nowhere: {} (for {:?} minutes)",
                rule.name, rule.expr, rule.pending
            );
        }
    }
}
