// Package platform is the runtime the three services share: configuration from the
// environment, logging, the database handle, the HTTP server with its health and metrics
// endpoints, and the lifecycle that runs everything under one errgroup until a signal.
package platform
