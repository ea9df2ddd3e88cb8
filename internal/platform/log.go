package platform

import (
	"io"
	"log/slog"
)

// NewLogger returns a text or JSON slog logger at level, tagged with the service name.
func NewLogger(w io.Writer, service, format, level string) *slog.Logger {
	var lvl slog.Level
	_ = lvl.UnmarshalText([]byte(level))
	opts := &slog.HandlerOptions{Level: lvl}
	var h slog.Handler = slog.NewTextHandler(w, opts)
	if format == "json" {
		h = slog.NewJSONHandler(w, opts)
	}
	return slog.New(h).With("service", service)
}
