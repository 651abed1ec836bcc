#!/bin/bash
# The broker's entry point: the official image's configuration rule, then one KRaft node.
#   KAFKA_<NAME>: the property <name>, lower-cased, "___" for "-", "__" for "_", "_" for ".";
#   CLUSTER_ID: the cluster id the data directory is formatted with on the first start (a
#   formatted directory keeps its own: the topics' IDs survive a restart with the volume).
set -euo pipefail

config=/opt/kafka/config/server.properties
: >"$config"
while IFS='=' read -r name value; do
    case "$name" in
        KAFKA_HEAP_OPTS | KAFKA_OPTS | KAFKA_JVM_OPTS) continue ;;
        KAFKA_*) ;;
        *) continue ;;
    esac
    key="${name#KAFKA_}"
    key="$(printf '%s' "$key" | tr '[:upper:]' '[:lower:]' | sed -e 's/___/-/g' -e 's/__/@/g' -e 's/_/./g' -e 's/@/_/g')"
    printf '%s=%s\n' "$key" "$value" >>"$config"
done < <(env)

cat >/opt/kafka/config/log4j2.xml <<'XML'
<?xml version="1.0" encoding="UTF-8"?>
<Configuration status="warn">
  <Appenders>
    <Console name="stdout" target="SYSTEM_OUT"><PatternLayout pattern="[%d] %p %m (%c)%n"/></Console>
  </Appenders>
  <Loggers>
    <Root level="${env:KAFKA_LOG_LEVEL:-info}"><AppenderRef ref="stdout"/></Root>
    <Logger name="kafka.request.logger" level="warn"/>
    <Logger name="org.apache.kafka.clients" level="warn"/>
  </Loggers>
</Configuration>
XML

java_opts=(-Djava.awt.headless=true -Dlog4j2.configurationFile=/opt/kafka/config/log4j2.xml -cp '/opt/kafka/libs/*')
log_dir="$(sed -n 's/^log\.dirs=//p' "$config" | cut -d, -f1)"
if [ -n "$log_dir" ] && [ ! -f "$log_dir/meta.properties" ]; then
    : "${CLUSTER_ID:?set CLUSTER_ID (a base64 UUID) to format a new data directory}"
    echo "formatting $log_dir with cluster id $CLUSTER_ID"
    java "${java_opts[@]}" kafka.tools.StorageTool format -t "$CLUSTER_ID" -c "$config"
fi
# shellcheck disable=SC2086  # the heap options are a list of words
exec java ${KAFKA_HEAP_OPTS:--Xms256m -Xmx768m} -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
    "${java_opts[@]}" kafka.Kafka "$config"
