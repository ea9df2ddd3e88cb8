package platform

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sync/errgroup"
)

// ShutdownTimeout bounds how long in-flight HTTP requests may take to finish after a signal.
// The workers' grace periods are shorter still (relay and consumer 5 s, the sender 4 s and 4 s
// to record); HardStop is what makes the 10 s of the contract hold whatever they do.
const ShutdownTimeout = 8 * time.Second

// HardStop is how long after a signal the process exits, whatever is still running: a service
// must exit within 10 s of it (the tests require it, and Kubernetes' grace period counts on
// it), and this leaves a margin. What it cuts off was not acknowledged, so the broker delivers
// it again, or not marked, so it is sent again: abandoned safely, like the grace periods'
// leftovers.
const HardStop = 9 * time.Second

// Main runs a service's run function with a context that ends on SIGINT or SIGTERM. If run
// fails, Main prints one line naming the service and exits 1.
func Main(service string, run func(ctx context.Context, env *Env) error) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	// After the first signal, a second one kills the process the default way.
	context.AfterFunc(ctx, stop)
	hardStop(ctx, HardStop, func() {
		logHardStop(os.Stderr, service, strings.ToLower(strings.TrimSpace(os.Getenv("LOG_FORMAT"))))
		os.Exit(0)
	})
	err := run(ctx, NewEnv())
	if ctx.Err() != nil && errors.Is(err, context.Canceled) {
		err = nil // stopped by a signal while starting: a clean exit
	}
	stop()
	if err != nil {
		// One line, whatever the error holds (pgx errors span several).
		fmt.Fprintf(os.Stderr, "%s: %s\n", service, strings.Join(strings.Fields(err.Error()), " "))
		os.Exit(1)
	}
}

// logHardStop writes the hard stop's line as the service's other lines are written (key=value,
// or JSON with LOG_FORMAT=json), though the logger its run function made is out of reach here.
func logHardStop(w io.Writer, service, format string) {
	NewLogger(w, service, format, "info").Error("still stopping after the signal; abandoning what is in flight (it was not acknowledged)", "after", HardStop)
}

// hardStop calls exit once after has passed since ctx ended, unless the process ended first.
func hardStop(ctx context.Context, after time.Duration, exit func()) {
	context.AfterFunc(ctx, func() { time.AfterFunc(after, exit) })
}

// Worker is a long-running part of a service (a relay, a consumer). It returns nil when its
// context ends.
type Worker func(ctx context.Context) error

// Serve runs srv and the workers under one errgroup until ctx ends or one of them fails, then
// shuts the server down gracefully: it stops accepting, finishes the requests in flight, and
// the workers settle their own work in progress.
func Serve(ctx context.Context, log *slog.Logger, srv *http.Server, workers ...Worker) error {
	ln, err := net.Listen("tcp", srv.Addr)
	if err != nil {
		return fmt.Errorf("HTTP_ADDR: listen on %s: %w", srv.Addr, err)
	}
	log.Info("listening", "addr", ln.Addr().String())
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			return fmt.Errorf("http server: %w", err)
		}
		return nil
	})
	g.Go(func() error {
		<-gctx.Done()
		log.Info("shutting down")
		shutdownCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ShutdownTimeout)
		defer cancel()
		if err := srv.Shutdown(shutdownCtx); err != nil {
			// A request still running at the deadline is cut off; that is the deadline's
			// purpose, not a failure of the service (nothing it did was committed half-way).
			log.Warn("HTTP requests still running at the shutdown deadline were cut off", "error", err)
			_ = srv.Close()
		}
		return nil
	})
	for _, w := range workers {
		g.Go(func() error { return w(gctx) })
	}
	if err := g.Wait(); err != nil {
		return err
	}
	log.Info("stopped")
	return nil
}
