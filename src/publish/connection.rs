//! Reaching NATS: the server list, how the relay proves who it is, and TLS.
//!
//! Every way NATS deployments authenticate is a setting: a credentials
//! file (operator mode, as `nsc` writes it), an nkey seed, a user with a
//! password file, a token file, or credentials written in the URL; and TLS
//! with a private CA, a client certificate, or TLS required. Secrets are
//! read from files at connect time, so they never pass through flags or
//! the environment, and none is ever shown (see [`crate::redact`]). A
//! server that refuses the credentials or the TLS handshake fails at once
//! with its own check kind, never a hang.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::{ConnectErrorKind, ConnectOptions, Event, ServerAddr};

use super::denials::Denials;
use crate::config::{read_secret, RelayConfig};
use crate::error::{CheckKind, Error, Result};
use crate::observe::{Metrics, Server};
use crate::redact;

/// Where NATS is, and how to authenticate and encrypt.
#[derive(Clone, Default)]
pub struct NatsConnection {
    /// One URL or several, comma-separated (`nats://a:4222,tls://b:4222`).
    pub urls: String,
    /// A credentials file: a user JWT and its nkey seed.
    pub creds: Option<PathBuf>,
    /// A file holding an nkey seed.
    pub nkey: Option<PathBuf>,
    /// A user name and the file holding its password.
    pub user: Option<(String, PathBuf)>,
    /// A file holding a token.
    pub token_file: Option<PathBuf>,
    /// The certificate authority to check the server's certificate against.
    pub tls_ca: Option<PathBuf>,
    /// A client certificate and its key, both PEM files.
    pub tls_client: Option<(PathBuf, PathBuf)>,
    /// Refuse a server that does not offer TLS.
    pub tls_required: bool,
    /// How long connecting may take.
    pub timeout: Duration,
}

impl NatsConnection {
    /// Plain URLs (with any credentials written in them).
    pub fn new(urls: impl Into<String>, timeout: Duration) -> Self {
        NatsConnection {
            urls: urls.into(),
            timeout,
            ..NatsConnection::default()
        }
    }

    /// The connection a relay's settings describe.
    pub fn for_config(config: &RelayConfig) -> Self {
        NatsConnection {
            urls: config.nats_url.clone(),
            creds: config.nats_creds.clone(),
            nkey: config.nats_nkey.clone(),
            user: config
                .nats_user
                .clone()
                .zip(config.nats_password_file.clone()),
            token_file: config.nats_token_file.clone(),
            tls_ca: config.nats_tls_ca.clone(),
            tls_client: config
                .nats_tls_cert
                .clone()
                .zip(config.nats_tls_key.clone()),
            tls_required: config.nats_tls_required,
            timeout: config.ack_timeout,
        }
    }

    /// Connects, logging connection changes; the client then reconnects
    /// by itself for as long as it lives.
    pub async fn connect(&self) -> Result<async_nats::Client> {
        self.open(&Session::default(), false).await
    }

    /// Connects for `session`: noting publish permission denials, counting
    /// reconnections, and never reconnecting once the session is retired.
    /// `in_background`: returns at once, the first connection made (and
    /// made again) behind; for a connection that replaces one whose server
    /// was checked already.
    pub(crate) async fn open(
        &self,
        session: &Session,
        in_background: bool,
    ) -> Result<async_nats::Client> {
        let servers = self.servers()?;
        let options = self.authenticated(self.tls(watched(session))?).await?;
        let retired = session.retired.clone();
        let options = options
            .name(&session.name)
            .connection_timeout(self.timeout)
            // A dead connection is noticed within three pings, so that what
            // is sent meanwhile waits in the client, not in a socket.
            .ping_interval(
                self.timeout
                    .clamp(Duration::from_secs(1), Duration::from_secs(60)),
            )
            .max_reconnects(None)
            .reconnect_delay_callback(move |attempts| reconnect_delay(attempts, &retired));
        let options = if in_background {
            options.retry_on_initial_connect()
        } else {
            options
        };
        options.connect(servers).await.map_err(|e| self.refused(e))
    }

    /// The server list, without the credentials the URLs may carry (they
    /// are sent apart, from [`url_credentials`], and the client logs the
    /// addresses it connects to).
    fn servers(&self) -> Result<Vec<ServerAddr>> {
        each_url(&self.urls)
            .map(|url| {
                redact::without_user_info(url)
                    .parse::<ServerAddr>()
                    .map_err(|e| {
                        Error::Config(format!(
                            "nats-url {} is not a NATS URL ({e}); write it like \
                         \"nats://host:4222\" or \"tls://host:4222\", several separated by commas",
                            redact::uri(url)
                        ))
                    })
            })
            .collect()
    }

    /// The credentials: from files the settings name, else from the URLs.
    async fn authenticated(&self, options: ConnectOptions) -> Result<ConnectOptions> {
        let in_urls = url_credentials(&self.urls);
        let from_files = self.creds.is_some()
            || self.nkey.is_some()
            || self.user.is_some()
            || self.token_file.is_some();
        if in_urls.len() > 1 {
            return Err(Error::Config(
                "nats-url carries different credentials on different servers; the relay \
                 authenticates one way to all of them: give one set"
                    .into(),
            ));
        }
        if from_files && !in_urls.is_empty() {
            return Err(Error::Config(
                "nats-url carries credentials, and another setting names more: give one".into(),
            ));
        }
        if let Some(path) = &self.creds {
            return options.credentials_file(path).await.map_err(|e| {
                Error::Config(format!("nats-creds: cannot use {}: {e}", path.display()))
            });
        }
        if let Some(path) = &self.nkey {
            return Ok(options.nkey(read_secret("nats-nkey", path)?));
        }
        if let Some((user, path)) = &self.user {
            let password = read_secret("nats-password-file", path)?;
            return Ok(options.user_and_password(user.clone(), password));
        }
        if let Some(path) = &self.token_file {
            return Ok(options.token(read_secret("nats-token-file", path)?));
        }
        Ok(match in_urls.into_iter().next() {
            Some((user, Some(password))) => options.user_and_password(user, password),
            Some((token, None)) => options.token(token),
            None => options,
        })
    }

    /// TLS as set: a CA or a client certificate implies TLS, so that a
    /// server that offers none is refused rather than talked to in clear.
    fn tls(&self, mut options: ConnectOptions) -> Result<ConnectOptions> {
        let readable = |setting: &str, path: &PathBuf| {
            if path.is_file() {
                Ok(path.clone())
            } else {
                Err(Error::Config(format!(
                    "{setting}: cannot read {}: no such file",
                    path.display()
                )))
            }
        };
        if let Some(ca) = &self.tls_ca {
            options = options.add_root_certificates(readable("nats-tls-ca", ca)?);
        }
        if let Some((cert, key)) = &self.tls_client {
            options = options.add_client_certificate(
                readable("nats-tls-cert", cert)?,
                readable("nats-tls-key", key)?,
            );
        }
        let implied = self.tls_ca.is_some() || self.tls_client.is_some();
        Ok(options.require_tls(self.tls_required || implied))
    }

    /// Why the first connection failed, as a start-up check's failure: a
    /// refusal of who the relay is, or a server not reached.
    fn refused(&self, error: async_nats::ConnectError) -> Error {
        let shown = redact::uri(&self.urls);
        let kind = match error.kind() {
            ConnectErrorKind::Io if is_tls_refusal(&error) => ConnectErrorKind::Tls,
            kind => kind,
        };
        match kind {
            ConnectErrorKind::AuthorizationViolation | ConnectErrorKind::Authentication => {
                Error::check(
                    CheckKind::NatsRefused,
                    format!(
                        "NATS at {shown} refused the relay's credentials ({error}); check \
                         --nats-creds, --nats-nkey, --nats-user with --nats-password-file, \
                         --nats-token-file, or the credentials in --nats-url"
                    ),
                )
            }
            ConnectErrorKind::Tls => Error::check(
                CheckKind::NatsRefused,
                format!(
                    "the TLS handshake with NATS at {shown} failed ({error}); check \
                     --nats-tls-ca, --nats-tls-cert and --nats-tls-key, and that the URL \
                     names the host on the server's certificate"
                ),
            ),
            _ => Error::check(
                CheckKind::NatsUnreachable,
                format!(
                    "cannot connect to NATS at {shown}: {error}; check --nats-url and that \
                     nats-server is running"
                ),
            ),
        }
    }
}

/// Whether an I/O failure is the TLS handshake refusing a certificate
/// (async-nats reports those as I/O errors).
fn is_tls_refusal(error: &async_nats::ConnectError) -> bool {
    use std::error::Error as _;
    let mut source = error.source();
    while let Some(cause) = source {
        if cause.is::<async_nats::rustls::Error>() {
            return true;
        }
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            if io
                .get_ref()
                .is_some_and(|inner| inner.is::<async_nats::rustls::Error>())
            {
                return true;
            }
        }
        source = cause.source();
    }
    false
}

/// One connection's name and what it reports to, and whether it is
/// retired: a retired connection never connects again, so what its client
/// holds queued is never sent (see `NatsPublisher`).
#[derive(Clone)]
pub(crate) struct Session {
    pub name: String,
    pub denials: Denials,
    pub metrics: Option<Metrics>,
    pub retired: Arc<AtomicBool>,
}

impl Default for Session {
    fn default() -> Self {
        Session {
            name: "outbox-relay".to_owned(),
            denials: Denials::default(),
            metrics: None,
            retired: Arc::default(),
        }
    }
}

/// How long a connection waits before its next try: as the client does by
/// default (at once, then doubling from 2 ms to 4 s), or, retired, as long
/// as a timer can wait (the process ends first), which is the only way the
/// client offers to never send what it holds.
fn reconnect_delay(attempts: usize, retired: &AtomicBool) -> Duration {
    if retired.load(Ordering::Acquire) {
        return Duration::from_secs(u64::from(u32::MAX));
    }
    if attempts <= 1 {
        return Duration::ZERO;
    }
    let doubled = 2_u64.saturating_pow(u32::try_from(attempts - 1).unwrap_or(u32::MAX));
    Duration::from_millis(doubled).min(Duration::from_secs(4))
}

/// Connection options that log connection changes once each, count
/// reconnections and note publish permission denials.
fn watched(session: &Session) -> ConnectOptions {
    let (denials, metrics) = (session.denials.clone(), session.metrics.clone());
    let retired = session.retired.clone();
    // Only a connection that follows a disconnection is a reconnection.
    let disconnected = Arc::new(AtomicBool::new(false));
    ConnectOptions::new().event_callback(move |event| {
        let (denials, metrics) = (denials.clone(), metrics.clone());
        let (disconnected, retired) = (disconnected.clone(), retired.clone());
        async move {
            match event {
                Event::Disconnected if retired.load(Ordering::Acquire) => {
                    tracing::info!(
                        "a former term's connection to NATS is gone; it does not reconnect, \
                         and what it held is not sent"
                    );
                }
                Event::Disconnected => {
                    disconnected.store(true, Ordering::Relaxed);
                    tracing::warn!("disconnected from NATS; reconnecting");
                }
                Event::Connected => {
                    tracing::info!("connected to NATS");
                    if let (true, Some(metrics)) =
                        (disconnected.swap(false, Ordering::Relaxed), metrics)
                    {
                        metrics.reconnected(Server::Nats);
                    }
                }
                Event::ServerError(async_nats::ServerError::Other(error)) => {
                    denials.note(&error);
                    tracing::debug!(%error, "NATS server error");
                }
                other => tracing::debug!(event = %other, "NATS connection event"),
            }
        }
    })
}

/// Connects to NATS at `url` the way the relay does: credentials in the URL
/// are used, connection changes are logged, and the client reconnects forever.
pub async fn connect_nats(url: &str, timeout: Duration) -> Result<async_nats::Client> {
    NatsConnection::new(url, timeout).connect().await
}

/// The URLs of a comma-separated list.
fn each_url(urls: &str) -> impl Iterator<Item = &str> {
    urls.split(',').map(str::trim).filter(|url| !url.is_empty())
}

/// The distinct credentials written in the URLs (`nats://user:pass@host`,
/// or `nats://token@host`), decoded. async-nats parses them but does not
/// send them (nats-io/nats.rs#1623), so the relay applies them itself.
fn url_credentials(urls: &str) -> Vec<(String, Option<String>)> {
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8_lossy()
            .into_owned()
    };
    let mut found: Vec<(String, Option<String>)> = Vec::new();
    for addr in each_url(urls).filter_map(|url| url.parse::<ServerAddr>().ok()) {
        if let Some(user) = addr.username() {
            let credential = (decode(user), addr.password().map(decode));
            if !found.contains(&credential) {
                found.push(credential);
            }
        }
    }
    found
}
