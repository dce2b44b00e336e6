# queue-gateway: multi-stage build, runs as a non-root user, health-checked.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml ./
COPY app ./app
RUN python -m venv /venv && /venv/bin/pip install --no-cache-dir .

FROM python:3.11-slim
RUN useradd --create-home --uid 10001 qgw
COPY --from=build /venv /venv
WORKDIR /srv/qgw
# lua/ and alembic/ are read beside the package at run time.
COPY --chown=qgw lua ./lua
COPY --chown=qgw alembic ./alembic
COPY --chown=qgw alembic.ini ./
COPY --chown=qgw app ./app
ENV PATH=/venv/bin:$PATH PYTHONPATH=/srv/qgw PYTHONUNBUFFERED=1 \
    QGW_HOST=0.0.0.0 QGW_PORT=8080 QGW_DATA_DIR=/data
RUN mkdir /data && chown qgw /data
USER qgw
VOLUME /data
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s \
  CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2).status != 200)"
CMD ["qgw", "serve"]
