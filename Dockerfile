# kvroute container image: a release build in a Rust image, copied into a small
# non-root runtime. No protoc is needed: build.rs uses protox.
# (No Docker engine runs on the development machines; this file is kept
# correct by review. Build with: docker build -t kvroute .)

FROM rust:1-slim-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock build.rs clippy.toml ./
COPY proto ./proto
COPY src ./src
# The workspace's other crates: the routing domain the server links, and
# the tools (`kvroute ctl` is how an operator asks the server what it knows).
COPY crates ./crates
# The server binary links no tool. The tools are built without the `plot`
# feature (kvroute replay --plot), so the image carries no SVG rasteriser or
# font loading.
RUN cargo build --release --locked -p kvroute --bin kvroute \
 && cargo build --release --locked -p kvroute-tools --no-default-features \
 && cp target/release/kvroute target/release/kvroute-tools /usr/local/bin/

FROM debian:bookworm-slim AS runtime
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin kvroute
COPY --from=build /usr/local/bin/kvroute /usr/local/bin/kvroute-tools /usr/local/bin/
USER 10001:10001
# Listen on every interface inside the container. On a non-loopback address
# kvroute refuses to start without client authentication (protected mode),
# and this image sets none on purpose: `docker run` must choose, either
# credentials (KVROUTE_TLS_CERT, KVROUTE_TLS_KEY, KVROUTE_TLS_CLIENT_CA,
# KVROUTE_AUTH_POLICY: files mounted into the container), or
# -e KVROUTE_ALLOW_UNAUTHENTICATED=true to let in anyone who reaches the port.
ENV KVROUTE_GRPC_ADDR=0.0.0.0:50051 \
    KVROUTE_METRICS_ADDR=0.0.0.0:9464 \
    KVROUTE_LOG_FORMAT=json
EXPOSE 50051 9464
ENTRYPOINT ["/usr/local/bin/kvroute"]
CMD ["serve"]
