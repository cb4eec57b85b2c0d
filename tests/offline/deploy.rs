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
