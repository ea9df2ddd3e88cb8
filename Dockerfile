# syntax=docker/dockerfile:1

# One image recipe for the three services; the SERVICE build argument picks which:
#   docker build --build-arg SERVICE=order -t outbox-inbox/order .
# docker-compose.yml builds all three.

FROM golang:1.26-bookworm AS build
WORKDIR /src

# Static binaries: the runtime image has no libc. The root module's replace directives point at
# the library's modules in this tree; the development workspace (go.work) is not needed.
ENV CGO_ENABLED=0 GOWORK=off

# Dependencies first, in their own layer: it is rebuilt only when a go.mod or go.sum changes.
COPY go.mod go.sum ./
COPY pkg/messaging/go.mod pkg/messaging/go.sum ./pkg/messaging/
COPY pkg/messaging/gormdriver/go.mod pkg/messaging/gormdriver/go.sum ./pkg/messaging/gormdriver/
COPY pkg/messaging/pgxdriver/go.mod pkg/messaging/pgxdriver/go.sum ./pkg/messaging/pgxdriver/
RUN go mod download

COPY . .

# The services are the folders of services/: adding one needs no change here.
ARG SERVICE
RUN test -n "${SERVICE}" && test -f "./services/${SERVICE}/main.go" || \
    { echo "build argument SERVICE must name a folder of services/ (got '${SERVICE}')" >&2; exit 1; }
RUN --mount=type=cache,target=/root/.cache/go-build \
    go build -trimpath -ldflags="-s -w" -o /out/service "./services/${SERVICE}" && \
    go build -trimpath -ldflags="-s -w" -o /out/healthcheck ./cmd/healthcheck && \
    go build -trimpath -ldflags="-s -w" -o /out/outboxctl ./cmd/outboxctl

# Debian 13: debian12 passed its end of life in September 2026.
# No shell, no package manager, runs as uid 65532. The compose healthchecks call
# /healthcheck, since there is no curl either. /outboxctl is the operator's tool, at hand in
# every service's container with its DATABASE_URL and AMQP_URL (its dlq commands log in as the
# service's own user, which may read that service's own dead-letter queue):
#   docker compose exec invoicing /outboxctl dlq list invoicing
FROM gcr.io/distroless/static-debian13:nonroot
COPY --from=build /out/service /service
COPY --from=build /out/healthcheck /healthcheck
COPY --from=build /out/outboxctl /outboxctl
USER nonroot:nonroot
ENTRYPOINT ["/service"]
