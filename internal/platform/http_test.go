package platform

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
)

// A 405 says in Allow which methods the resource has (RFC 9110, section 15.5.6), in
// subrouters too, though chi does not hand a MethodNotAllowed handler of one's own the list.
func TestMethodNotAllowedSaysWhichAre(t *testing.T) {
	t.Parallel()
	log, _ := testenv.NewLogger(t)
	r := NewRouter(log, prometheus.NewRegistry(), func(context.Context) error { return nil })
	ok := func(http.ResponseWriter, *http.Request) {}
	r.Post("/orders", ok)
	r.Get("/orders/{id}", ok)
	r.Post("/orders/{id}/cancel", ok)
	r.Route("/things", func(s chi.Router) {
		s.Get("/{id}", ok)
		s.Put("/{id}", ok)
		s.Delete("/{id}", ok)
	})
	for _, c := range []struct{ method, path, allow string }{
		{http.MethodGet, "/orders", "POST"},
		{http.MethodDelete, "/orders/42", "GET"},
		{http.MethodHead, "/orders/42", "GET"},
		{http.MethodGet, "/orders/42/cancel", "POST"},
		{http.MethodPost, "/healthz", "GET"},
		{http.MethodPut, "/readyz", "GET"},
		{http.MethodPost, "/things/7", "GET, PUT, DELETE"},
	} {
		rec := httptest.NewRecorder()
		r.ServeHTTP(rec, httptest.NewRequest(c.method, c.path, nil))
		if rec.Code != http.StatusMethodNotAllowed || rec.Header().Get("Content-Type") != "application/problem+json" || rec.Header().Get("Allow") != c.allow {
			t.Errorf("%s %s = %d %s, Allow %q; want a 405 problem with Allow %q", c.method, c.path, rec.Code, rec.Header().Get("Content-Type"), rec.Header().Get("Allow"), c.allow)
		}
	}
}
