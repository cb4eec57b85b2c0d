# The relay as a container: `docker build .` (or `podman build .`) compiles
# it in a Rust stage and copies the stripped binary into a small runtime.
#
# The runtime is distroless `cc` (Debian 12): glibc and libgcc, which the
# binary links against, CA certificates for Atlas and TLS NATS, a nonroot
# user, and no shell or package manager to patch. Build arguments swap
# either stage without another Dockerfile: BINARY=prebuilt takes
# target/dist/outbox-relay (`cargo build --profile dist`) from the build
# context instead of compiling, and RUNTIME_IMAGE names another base with
# glibc and CA certificates (scripts/image.sh uses both to build without a
# registry).
ARG RUST_IMAGE=docker.io/library/rust:1-bookworm
ARG RUNTIME_IMAGE=gcr.io/distroless/cc-debian12:nonroot
ARG BINARY=compiled

FROM ${RUST_IMAGE} AS compiled
WORKDIR /src
COPY . .
RUN cargo build --profile dist --locked --bin outbox-relay \
 && cp target/dist/outbox-relay /outbox-relay

FROM scratch AS prebuilt
COPY target/dist/outbox-relay /outbox-relay

FROM ${BINARY} AS binary

FROM ${RUNTIME_IMAGE}
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG SOURCE=
LABEL org.opencontainers.image.title="outbox-relay" \
      org.opencontainers.image.description="Transactional-outbox relay for MongoDB and NATS" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="MIT OR Apache-2.0"
COPY --from=binary /outbox-relay /usr/local/bin/outbox-relay
# A probe or a scrape comes from outside the container: listen on every
# interface, not the binary's default of loopback.
ENV OUTBOX_METRICS_ADDR=0.0.0.0:9464
EXPOSE 9464
# Numeric, so that runAsNonRoot can check it without /etc/passwd.
USER 65532:65532
# The relay is PID 1: SIGTERM reaches it, and it stops gracefully.
ENTRYPOINT ["/usr/local/bin/outbox-relay"]
CMD ["--help"]
