#!/bin/sh
# The official image's /opt/kafka/bin/kafka-topics.sh, for docker-compose.yml's healthcheck
# and topic creation: the tools' TopicCommand from the same jars, warnings only.
exec java -Xmx256m -Djava.awt.headless=true -Dlog4j2.level=warn -cp '/opt/kafka/libs/*' \
    org.apache.kafka.tools.TopicCommand "$@"
