//! Each way a secured server is reached, against a real server set up for
//! it. NATS: a user with a password file, a token file, an nkey, operator
//! mode with a credentials file, TLS with a private CA, and mutual TLS.
//! MongoDB: TLS with a private CA, and a user with a password. The start-up
//! check passes with the right credentials; the wrong ones fail it at once
//! with their own exit code (10 for NATS, 3 for MongoDB) and a message
//! that names what to check, never a hang.

use std::path::Path;
use std::process::Output;

use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};

use crate::common::{
    assert_exit, bounded, output_text as text, relay_command, MongoProcess, NatsProcess, TestEnv,
};

/// Runs `check` in core mode (no stream needed) against `nats`.
async fn check(env: &TestEnv, url: &str, args: &[&str]) -> Output {
    let mut command = relay_command(env);
    command
        .args(["check", "--nats-mode", "core", "--nats-url", url])
        .args(args)
        // The client's own debug logs name the servers it connects to;
        // no secret may be among them.
        .env("RUST_LOG", "debug");
    bounded(command).await
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write a test file");
    path.display().to_string()
}

fn plain_url(nats: &NatsProcess) -> String {
    format!("nats://127.0.0.1:{}", nats.port)
}

#[tokio::test]
async fn a_user_with_a_password_file_and_a_token_file_are_accepted_or_refused() {
    let env = TestEnv::new().await;
    let users = NatsProcess::start_secured(
        "authorization { user: relay, password: \"pw-of-relay\" }",
        &[],
    )
    .await;
    let good = write(users.dir(), "password", "pw-of-relay\n");
    let bad = write(users.dir(), "wrong", "not-the-password");
    let url = plain_url(&users);
    for (file, code, saying) in [
        (&good, 0, "ok    nats"),
        (&bad, 10, "refused the relay's credentials"),
    ] {
        let with_user = ["--nats-user", "relay", "--nats-password-file", file];
        let output = check(&env, &url, &with_user).await;
        assert_exit(&output, code, saying);
        let said = text(&output);
        assert!(
            !said.contains("pw-of-relay") && !said.contains("not-the-password"),
            "{said}"
        );
    }
    assert_exit(
        &check(&env, &url, &[]).await,
        10,
        "refused the relay's credentials",
    );

    let tokens = NatsProcess::start_secured("authorization { token: \"tok-of-relay\" }", &[]).await;
    let good = write(tokens.dir(), "token", "tok-of-relay");
    let bad = write(tokens.dir(), "wrong", "tok-of-someone");
    let url = plain_url(&tokens);
    assert_exit(
        &check(&env, &url, &["--nats-token-file", &good]).await,
        0,
        "ok    nats",
    );
    assert_exit(
        &check(&env, &url, &["--nats-token-file", &bad]).await,
        10,
        "refused",
    );
    env.drop().await;
}

#[tokio::test]
async fn an_nkey_seed_file_authenticates() {
    let env = TestEnv::new().await;
    let user = nkeys::KeyPair::new_user();
    let stranger = nkeys::KeyPair::new_user();
    let nats = NatsProcess::start_secured(
        &format!(
            "authorization {{ users: [ {{ nkey: {} }} ] }}",
            user.public_key()
        ),
        &[],
    )
    .await;
    let seed = write(nats.dir(), "relay.nk", &user.seed().expect("a seed"));
    let other = write(nats.dir(), "other.nk", &stranger.seed().expect("a seed"));
    let url = plain_url(&nats);
    assert_exit(
        &check(&env, &url, &["--nats-nkey", &seed]).await,
        0,
        "ok    nats",
    );
    assert_exit(
        &check(&env, &url, &["--nats-nkey", &other]).await,
        10,
        "refused",
    );
    env.drop().await;
}

/// A private CA, a server certificate for 127.0.0.1 and a client
/// certificate, all signed by it: (file name, PEM) pairs.
fn certificates() -> Vec<(&'static str, String)> {
    let ca_key = KeyPair::generate().expect("a CA key");
    let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca.self_signed(&ca_key).expect("a CA certificate");
    let signed = |names: Vec<String>| {
        let key = KeyPair::generate().expect("a key");
        let cert = CertificateParams::new(names)
            .expect("parameters")
            .signed_by(&key, &ca, &ca_key)
            .expect("a certificate");
        (cert.pem(), key.serialize_pem())
    };
    let (server, server_key) = signed(vec!["127.0.0.1".into(), "localhost".into()]);
    let (client, client_key) = signed(vec!["relay".into()]);
    vec![
        ("ca.pem", ca.pem()),
        ("server.pem", server),
        ("server-key.pem", server_key),
        ("client.pem", client),
        ("client-key.pem", client_key),
    ]
}

#[tokio::test]
async fn tls_with_a_private_ca_and_with_client_certificates() {
    let env = TestEnv::new().await;
    let pems = certificates();
    let files: Vec<(&str, &str)> = pems.iter().map(|(n, p)| (*n, p.as_str())).collect();
    let server_tls = "cert_file: \"{dir}/server.pem\"\nkey_file: \"{dir}/server-key.pem\"";
    let tls = NatsProcess::start_secured(&format!("tls {{ {server_tls} }}"), &files).await;
    let dir = tls.dir().display().to_string();
    let ca = format!("{dir}/ca.pem");
    let url = format!("tls://127.0.0.1:{}", tls.port);
    assert_exit(
        &check(&env, &url, &["--nats-tls-ca", &ca]).await,
        0,
        "ok    nats",
    );
    assert_exit(
        &check(&env, &url, &["--nats-tls-ca", &ca, "--nats-tls-required"]).await,
        0,
        "ok    nats",
    );
    // A CA implies TLS: a server in clear is refused, not talked to.
    let in_clear = check(&env, &env.nats_url, &["--nats-tls-ca", &ca]).await;
    assert_exit(&in_clear, 10, "TLS");
    let missing = check(&env, &url, &["--nats-tls-ca", "/nonexistent/ca.pem"]).await;
    assert_exit(&missing, 2, "nats-tls-ca: cannot read /nonexistent/ca.pem");
    // Without the private CA the server's certificate is not trusted.
    assert_exit(&check(&env, &url, &[]).await, 10, "TLS handshake");

    let mutual = NatsProcess::start_secured(
        &format!("tls {{ {server_tls}\nca_file: \"{{dir}}/ca.pem\"\nverify: true }}"),
        &files,
    )
    .await;
    let dir = mutual.dir().display().to_string();
    let (ca, cert, key) = (
        format!("{dir}/ca.pem"),
        format!("{dir}/client.pem"),
        format!("{dir}/client-key.pem"),
    );
    let url = format!("tls://127.0.0.1:{}", mutual.port);
    let with_client = [
        "--nats-tls-ca",
        &ca,
        "--nats-tls-cert",
        &cert,
        "--nats-tls-key",
        &key,
    ];
    assert_exit(&check(&env, &url, &with_client).await, 0, "ok    nats");
    let without = check(&env, &url, &["--nats-tls-ca", &ca]).await;
    assert!(
        matches!(without.status.code(), Some(6 | 10)),
        "a server that verifies clients turns one without a certificate away: {}",
        text(&without)
    );
    env.drop().await;
}

#[tokio::test]
async fn a_list_of_servers_is_accepted_with_credentials_on_any() {
    let env = TestEnv::new().await;
    let users = NatsProcess::start_secured(
        "authorization { user: relay, password: \"pw-of-relay\" }",
        &[],
    )
    .await;
    // The first server accepts connections and never speaks: the client
    // gives up on it (and logs it at debug) before trying the next.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("a silent server");
    let list = format!(
        "nats://relay:pw-of-relay@{},nats://relay:pw-of-relay@127.0.0.1:{}",
        silent.local_addr().expect("its address"),
        users.port
    );
    let output = check(&env, &list, &["--ack-timeout", "1s"]).await;
    assert_exit(&output, 0, "ok    nats");
    let token = write(users.dir(), "token", "tok");
    let twice = check(&env, &list, &["--nats-token-file", &token]).await;
    assert_exit(
        &twice,
        2,
        "nats-url carries credentials, and another setting",
    );
    let two_sets = format!(
        "nats://a:1@127.0.0.1:1,nats://relay:pw-of-relay@127.0.0.1:{}",
        users.port
    );
    assert_exit(
        &check(&env, &two_sets, &[]).await,
        2,
        "different credentials",
    );
    assert!(!text(&output).contains("pw-of-relay"), "{}", text(&output));
    env.drop().await;
}

/// A JWT as NATS's operator mode signs them: claims about `subject`,
/// issued and signed by `issuer`.
fn jwt(issuer: &nkeys::KeyPair, subject: &str, name: &str, nats: serde_json::Value) -> String {
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;
    use base64::Engine;
    let header = URL_SAFE_NO_PAD.encode(r#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
    let claims = serde_json::json!({
        "jti": bson::oid::ObjectId::new().to_hex(),
        "iat": 1_700_000_000,
        "iss": issuer.public_key(),
        "name": name,
        "sub": subject,
        "nats": nats,
    });
    let claims = URL_SAFE_NO_PAD.encode(claims.to_string());
    let signed = format!("{header}.{claims}");
    let signature = issuer.sign(signed.as_bytes()).expect("a signature");
    format!("{signed}.{}", URL_SAFE_NO_PAD.encode(signature))
}

/// A credentials file as `nsc` writes it: the user's JWT and seed.
fn creds(user_jwt: &str, user: &nkeys::KeyPair) -> String {
    format!(
        "-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n\
         -----BEGIN USER NKEY SEED-----\n{}\n------END USER NKEY SEED------\n",
        user.seed().expect("a seed")
    )
}

#[tokio::test]
async fn an_operator_mode_credentials_file_authenticates() {
    let env = TestEnv::new().await;
    let operator = nkeys::KeyPair::new_operator();
    let account = nkeys::KeyPair::new_account();
    let stranger_account = nkeys::KeyPair::new_account();
    let user = nkeys::KeyPair::new_user();
    let unlimited = serde_json::json!({
        "limits": { "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
                    "wildcards": true, "conn": -1, "leaf": -1 },
        "type": "account", "version": 2,
    });
    let operator_jwt = jwt(
        &operator,
        &operator.public_key(),
        "O",
        serde_json::json!({ "type": "operator", "version": 2 }),
    );
    let account_jwt = jwt(&operator, &account.public_key(), "A", unlimited);
    let user_claims = serde_json::json!({
        "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1,
        "type": "user", "version": 2,
    });
    let user_jwt = jwt(&account, &user.public_key(), "relay", user_claims.clone());
    // Signed by an account the server does not know.
    let stranger_jwt = jwt(&stranger_account, &user.public_key(), "relay", user_claims);
    let nats = NatsProcess::start_secured(
        &format!(
            "operator: {operator_jwt}\nresolver: MEMORY\n\
             resolver_preload: {{ {}: {account_jwt} }}",
            account.public_key()
        ),
        &[],
    )
    .await;
    let good = write(nats.dir(), "relay.creds", &creds(&user_jwt, &user));
    let bad = write(nats.dir(), "stranger.creds", &creds(&stranger_jwt, &user));
    let url = plain_url(&nats);
    assert_exit(
        &check(&env, &url, &["--nats-creds", &good]).await,
        0,
        "ok    nats",
    );
    assert_exit(
        &check(&env, &url, &["--nats-creds", &bad]).await,
        10,
        "refused",
    );
    let missing = check(&env, &url, &["--nats-creds", "/nonexistent.creds"]).await;
    assert_exit(&missing, 2, "nats-creds: cannot use /nonexistent.creds");
    env.drop().await;
}

/// Runs `check` against a private MongoDB at `uri` (the shared NATS).
async fn check_mongodb(env: &TestEnv, uri: &str) -> Output {
    let mut command = relay_command(env);
    command.args(["check", "--nats-mode", "core", "--mongodb-uri", uri]);
    bounded(command).await
}

#[tokio::test]
async fn mongodb_over_tls_with_a_private_ca() {
    let env = TestEnv::new().await;
    let pems = certificates();
    let mut mongo = MongoProcess::unstarted(Vec::new());
    let folder = mongo.dir().with_extension("tls");
    std::fs::create_dir_all(&folder).expect("a folder for certificates");
    for (name, pem) in &pems {
        write(&folder, name, pem);
    }
    let file = |name: &str| folder.join(name).display().to_string();
    mongo.extra = vec![
        "--tls-cert-file".into(),
        file("server.pem"),
        "--tls-key-file".into(),
        file("server-key.pem"),
    ];
    mongo.options = format!("&tls=true&tlsCAFile={}", file("ca.pem"));
    mongo.restart().await;

    assert_exit(&check_mongodb(&env, &mongo.uri()).await, 0, "ok    mongodb");
    let untrusted = format!(
        "mongodb://127.0.0.1:{}/?serverSelectionTimeoutMS=1000&tls=true",
        mongo.port
    );
    assert_exit(
        &check_mongodb(&env, &untrusted).await,
        3,
        "cannot reach MongoDB",
    );
    drop(mongo);
    let _ = std::fs::remove_dir_all(&folder);
    env.drop().await;
}

#[tokio::test]
async fn mongodb_with_a_user_and_password() {
    let env = TestEnv::new().await;
    let mut mongo = MongoProcess::start_with(&[]).await;
    let admin = mongodb::Client::with_uri_str(mongo.uri())
        .await
        .expect("a client")
        .database("admin");
    admin
        .run_command(bson::doc! {
            "createUser": "relay", "pwd": "pw-of-relay", "roles": ["root"],
        })
        .await
        .expect("create the relay's user");
    mongo.stop();
    mongo.extra = vec!["--auth".into()];
    mongo.restart().await;
    let uri = |password: &str| {
        format!(
            "mongodb://relay:{password}@127.0.0.1:{}/?authSource=admin&serverSelectionTimeoutMS=1000",
            mongo.port
        )
    };
    assert_exit(
        &check_mongodb(&env, &uri("pw-of-relay")).await,
        0,
        "ok    mongodb",
    );
    let refused = check_mongodb(&env, &uri("not-the-password")).await;
    assert_exit(&refused, 3, "cannot reach MongoDB");
    assert!(
        !text(&refused).contains("not-the-password"),
        "{}",
        text(&refused)
    );
    env.drop().await;
}
