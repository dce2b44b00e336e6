# queue-gateway: multi-stage build, runs as a non-root user, health-checked.
# Build stage: the package and its dependencies into a venv (compilers stay out of the image).
FROM python:3.11-slim AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml ./
COPY app ./app
RUN python -m venv /venv && /venv/bin/pip install .

FROM python:3.11-slim
RUN useradd --create-home --uid 10001 qgw
COPY --from=build /venv /venv
WORKDIR /srv/qgw
# lua/ and alembic/ are read beside the package (app.ROOT), so the package runs from here
# (PYTHONPATH), not from the venv's copy; files stay root-owned: the app only reads them.
COPY lua ./lua
COPY alembic ./alembic
COPY alembic.ini ./
COPY app ./app
ENV PATH=/venv/bin:$PATH PYTHONPATH=/srv/qgw PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    QGW_HOST=0.0.0.0 QGW_PORT=8080 QGW_DATA_DIR=/data
RUN mkdir /data && chown qgw /data
USER qgw
VOLUME /data
EXPOSE 8080
# Liveness of the HTTP roles (serve, api); compose overrides it for the others.
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import os, sys, urllib.request as u; sys.exit(u.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('QGW_PORT', '8080'), timeout=2).status != 200)"]
# SIGTERM: the dispatcher finishes calls in flight within QGW_SHUTDOWN_GRACE_S, hands the rest back.
STOPSIGNAL SIGTERM
CMD ["qgw", "serve"]
