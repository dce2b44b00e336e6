# queue-gateway: multi-stage build, runs as a non-root numeric user, health-checked.
# Build stage: the dependencies, then the package, into a venv (compilers stay out of the image).
FROM python:3.11-slim AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
# The dependencies alone first, exactly as locked (versions and hashes, `make lock`): a change
# to the code reuses this layer.
COPY requirements/run.txt ./requirements/run.txt
RUN python -m venv /venv \
 && /venv/bin/pip install --no-cache-dir --require-hashes -r requirements/run.txt
# Then the package itself (its wheel carries lua/ and alembic/, see setup.py), nothing else.
COPY pyproject.toml setup.py MANIFEST.in ./
COPY app ./app
COPY lua ./lua
COPY alembic ./alembic
RUN /venv/bin/pip install --no-cache-dir --no-deps .

FROM python:3.11-slim
# A passwd entry for tools that look the user up; USER names it by number, so a runtime that
# insists on non-root (Kubernetes runAsNonRoot) can check it without one.
RUN useradd --system --no-log-init --no-create-home --uid 10001 --user-group qgw \
 && mkdir /data && chown 10001:10001 /data
COPY --from=build /venv /venv
ENV PATH=/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    QGW_HOST=0.0.0.0 QGW_PORT=8080 QGW_DATA_DIR=/data
USER 10001:10001
WORKDIR /data
VOLUME /data
EXPOSE 8080
# The HTTP roles (serve, api): GET /healthz. compose.yaml gives dispatchers their heartbeat
# check (`qgw healthcheck --role dispatcher`) and the one-shot migrate none.
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
  CMD ["qgw", "healthcheck"]
# SIGTERM: the dispatcher finishes calls in flight within QGW_SHUTDOWN_GRACE_S, hands the rest back.
STOPSIGNAL SIGTERM
CMD ["qgw", "serve"]
