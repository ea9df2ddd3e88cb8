package main

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// service answers as a service's health endpoints may: ready, unready, unready after the
// database's ping gave up, other statuses, a redirect, too slow.
func service(t *testing.T) *httptest.Server {
	t.Helper()
	mux := http.NewServeMux()
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	mux.HandleFunc("/unready", func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "database unavailable", http.StatusServiceUnavailable)
	})
	// A service whose database stalls answers its 503 once the readiness check's 2 s ping gives up.
	mux.HandleFunc("/stalled", func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-time.After(2100 * time.Millisecond):
			http.Error(w, "the database does not answer", http.StatusServiceUnavailable)
		}
	})
	// As platform.WriteProblem answers /readyz: the reason in the problem's detail, here over
	// two lines and long, as a reason never is, to show the line stays one and bounded.
	mux.HandleFunc("/problem", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(http.StatusServiceUnavailable)
		_, _ = io.WriteString(w, `{"type":"about:blank","title":"Service Unavailable","status":503,"detail":"the database\ndoes not answer`+strings.Repeat(" x", 500)+`"}`)
	})
	mux.HandleFunc("/created", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusCreated) })
	mux.HandleFunc("/moved", func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, "/readyz", http.StatusFound)
	})
	mux.HandleFunc("/slow", func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-time.After(5 * time.Second):
		}
	})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv
}

func TestCheck(t *testing.T) {
	t.Parallel()
	srv := service(t)
	closed := httptest.NewServer(http.NotFoundHandler())
	closedURL := closed.URL
	closed.Close()

	tests := []struct {
		name    string
		url     string
		wantErr string // "" for success
	}{
		{"200 is healthy", srv.URL + "/readyz", ""},
		{"503 is unhealthy", srv.URL + "/unready", "503 Service Unavailable"},
		{"a stalled database's 503 is read", srv.URL + "/stalled", "503 Service Unavailable"},
		{"a problem's detail is the reason", srv.URL + "/problem", "503 Service Unavailable: the database does not answer x x"},
		{"only 200 counts", srv.URL + "/created", "201 Created"},
		{"redirects are not followed", srv.URL + "/moved", "302 Found"},
		{"404 is unhealthy", srv.URL + "/nope", "404 Not Found"},
		{"timeout", srv.URL + "/slow", "no answer within the timeout"},
		{"nothing listening", closedURL + "/readyz", "connect"},
		{"malformed URL", "http://%zz/readyz", "invalid URL escape"},
		{"not HTTP", "ftp://127.0.0.1/readyz", "unsupported protocol scheme"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			// The timeout case waits out a short deadline; the others get the real one's room
			// to answer, since a local round trip under -race on two busy cores has taken
			// over 300 ms (TestAdmissionShedsTheExcessAtOnce).
			deadline := timeout
			if tt.url == srv.URL+"/slow" {
				deadline = 200 * time.Millisecond
			}
			ctx, cancel := context.WithTimeout(context.Background(), deadline)
			defer cancel()
			err := check(ctx, tt.url)
			switch {
			case tt.wantErr == "":
				if err != nil {
					t.Fatalf("check(%q) = %v, want nil", tt.url, err)
				}
			case err == nil:
				t.Fatalf("check(%q) = nil, want an error containing %q", tt.url, tt.wantErr)
			case !strings.Contains(err.Error(), tt.wantErr):
				t.Fatalf("check(%q) = %q, want it to contain %q", tt.url, err, tt.wantErr)
			case strings.Contains(err.Error(), "\n"):
				t.Fatalf("check(%q) error spans several lines: %q", tt.url, err)
			case len(err.Error()) > len(tt.url)+maxDetail+100:
				t.Fatalf("check(%q) error is %d bytes long, want the detail cut to %d", tt.url, len(err.Error()), maxDetail)
			}
		})
	}
}

// TestMain runs main itself when a test re-executes this binary as the healthcheck.
func TestMain(m *testing.M) {
	if os.Getenv("HEALTHCHECK_AS_MAIN") == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// The command's exit status is what the container runtime reads: 0 on a 200 only, 1 on any
// other answer, on a refused connection and on a wrong command line, each with a line why.
func TestExitStatus(t *testing.T) {
	t.Parallel()
	srv := service(t)
	closed := httptest.NewServer(http.NotFoundHandler())
	closed.Close()
	for _, tc := range []struct {
		name string
		args []string
		want int
	}{
		{"ready", []string{srv.URL + "/readyz"}, 0},
		{"unready", []string{srv.URL + "/unready"}, 1},
		{"refused", []string{closed.URL + "/readyz"}, 1},
		{"two URLs", []string{srv.URL + "/readyz", srv.URL + "/readyz"}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cmd := exec.Command(os.Args[0], tc.args...)
			cmd.Env = append(os.Environ(), "HEALTHCHECK_AS_MAIN=1")
			var stderr strings.Builder
			cmd.Stderr = &stderr
			err := cmd.Run()
			got := 0
			if exit := (*exec.ExitError)(nil); errors.As(err, &exit) {
				got = exit.ExitCode()
			} else if err != nil {
				t.Fatal(err)
			}
			if got != tc.want || (tc.want != 0) != (stderr.Len() > 0) {
				t.Fatalf("healthcheck %v: exit %d, stderr %q; want exit %d, a line only on failure", tc.args, got, stderr.String(), tc.want)
			}
		})
	}
}
