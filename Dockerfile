# The projector and the gateway in one image (two binaries, and the `parsley` CLI), built from
# source. Used by docker-compose.yml. (`make compose-test` builds the same image from binaries
# built on the host instead: compose/parsley/Containerfile.)
# The toolchain the project is built and tested with (rustc 1.95), on the same Debian release
# as the run-time image.
FROM rust:1.95-bookworm AS build
WORKDIR /src
# librdkafka is built from the crate's bundled sources with TLS (SASL SCRAM included) and
# zstd: a C toolchain, make and perl (present in this image), the zlib and OpenSSL headers,
# and pkg-config to find OpenSSL. (TLS to Postgres is rustls with ring, built by the same C
# toolchain.)
RUN apt-get update \
 && apt-get install -y --no-install-recommends zlib1g-dev libssl-dev pkg-config \
 && rm -rf /var/lib/apt/lists/*
COPY . .
RUN cargo build --release -p parsley-projector -p parsley-gateway -p parsley-cli \
 && cp target/release/parsley-projector target/release/parsley-gateway target/release/parsley /usr/local/bin/

FROM debian:bookworm-slim
# The run-time libraries the binaries link (OpenSSL 3 for Kafka, zlib) and the CA certificates
# that TLS to Kafka and Postgres verifies against by default.
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates libssl3 zlib1g \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 parsley
COPY --from=build /usr/local/bin/parsley-projector /usr/local/bin/parsley-gateway /usr/local/bin/parsley /usr/local/bin/
COPY config /etc/parsley
ENV PARSLEY_CONFIG=/etc/parsley/compose.toml
USER parsley
