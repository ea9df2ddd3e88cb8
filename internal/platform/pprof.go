package platform

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"time"
)

// Profiler serves Go's profiler (/debug/pprof/) on addr, a listener of its own so that it is
// never exposed with the service's API, until ctx ends. With addr "" it serves nothing.
func Profiler(log *slog.Logger, addr string) Worker {
	return func(ctx context.Context) error {
		if addr == "" {
			return nil
		}
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			return fmt.Errorf("PPROF_ADDR: listen on %s: %w", addr, err)
		}
		log.Info("profiler listening", "addr", ln.Addr().String())
		return serveProfiler(ctx, log, ln)
	}
}

// serveProfiler serves the profiler on ln until ctx ends.
func serveProfiler(ctx context.Context, log *slog.Logger, ln net.Listener) error {
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	// A CPU profile takes as long as it is asked to: no write timeout.
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: ReadHeaderTimeout, ErrorLog: serverErrorLog(log)}
	stop := context.AfterFunc(ctx, func() {
		shutdownCtx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = srv.Shutdown(shutdownCtx)
	})
	defer stop()
	if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("profiler: %w", err)
	}
	return nil
}
