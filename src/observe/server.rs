//! The HTTP endpoints: `/metrics`, `/healthz` and `/readyz`.
//!
//! `/healthz` answers while the process can answer at all; `/readyz` answers
//! 200 only while the relay is connected to both servers and either leads
//! with its change stream open, polls, or stands by ready to take over, and
//! 503 otherwise, with one line a condition saying which.

use std::net::SocketAddr;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::Metrics;
use crate::error::{Error, Result};

/// The endpoints being served.
pub struct Endpoints {
    /// The address bound (useful when the port was 0).
    pub addr: SocketAddr,
    /// Ends after `stop` fires and open requests finish.
    pub task: JoinHandle<()>,
}

/// Binds `addr` and serves the endpoints for `metrics` until `stop` fires.
pub async fn serve(
    addr: SocketAddr,
    metrics: Metrics,
    stop: CancellationToken,
) -> Result<Endpoints> {
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        Error::io(
            format!("cannot serve metrics on {addr} (pass another --metrics-addr, or \"off\")"),
            e,
        )
    })?;
    let addr = listener.local_addr().unwrap_or(addr);
    let app = Router::new()
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readiness))
        .with_state(metrics);
    let task = tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(stop.cancelled_owned())
            .await;
        if let Err(error) = served {
            tracing::warn!(%error, "the metrics endpoint stopped");
        }
    });
    tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
    Ok(Endpoints { addr, task })
}

async fn metrics_text(State(metrics): State<Metrics>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
        )],
        metrics.render(),
    )
}

async fn readiness(State(metrics): State<Metrics>) -> impl IntoResponse {
    let readiness = metrics.readiness();
    let code = if readiness.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let verdict = if readiness.ready {
        "ready"
    } else {
        "not ready"
    };
    (
        code,
        format!("{verdict}\n{}\n", readiness.conditions.join("\n")),
    )
}
