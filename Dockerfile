# The projector and the gateway in one image (two binaries). Used by docker-compose.yml.
FROM rust:1-bookworm AS build
WORKDIR /src
# librdkafka is built from the crate's bundled sources: it needs a C toolchain (present in
# this image), make, perl and zlib headers.
RUN apt-get update \
 && apt-get install -y --no-install-recommends zlib1g-dev \
 && rm -rf /var/lib/apt/lists/*
COPY . .
RUN cargo build --release -p parsley-projector -p parsley-gateway -p parsley-cli \
 && cp target/release/parsley-projector target/release/parsley-gateway target/release/parsley /usr/local/bin/

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates zlib1g \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 parsley
COPY --from=build /usr/local/bin/parsley-projector /usr/local/bin/parsley-gateway /usr/local/bin/parsley /usr/local/bin/
COPY config /etc/parsley
ENV PARSLEY_CONFIG=/etc/parsley/compose.toml
USER parsley
