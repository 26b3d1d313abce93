# Prometheus from Debian's package, on the same base as pdserve's image: it builds wherever
# pdserve's does, registry or not. Config and alert rules are mounted by docker-compose.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends prometheus \
    && rm -rf /var/lib/apt/lists/*
EXPOSE 9090
ENTRYPOINT ["prometheus", "--config.file=/etc/prometheus/prometheus.yml", \
            "--storage.tsdb.path=/prometheus", "--web.listen-address=:9090"]
