// Command healthcheck is the container healthcheck of the services' images. The runtime image
// is distroless (no shell, no curl), so this GETs one URL and exits 0 when the answer is
// HTTP 200, 1 otherwise, printing one line that says why: the status, and the detail of a
// problem body (/readyz's reason).
//
// Usage:
//
//	healthcheck [URL]
//
// URL defaults to http://127.0.0.1:8080/readyz; docker-compose.yml passes each service's own.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"os"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"
)

const defaultURL = "http://127.0.0.1:8080/readyz"

// timeout outlasts the readiness check's own 2 s ping of the database, so a stalled database
// shows as its 503 and reason, not as no answer; and ends before compose's healthcheck timeout
// (3 s), so the line saying why is printed.
const timeout = 2500 * time.Millisecond

func main() {
	url := defaultURL
	switch len(os.Args) {
	case 1:
	case 2:
		url = os.Args[1]
	default:
		fmt.Fprintln(os.Stderr, "usage: healthcheck [URL]")
		os.Exit(1)
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	err := check(ctx, url)
	cancel()
	if err != nil {
		fmt.Fprintf(os.Stderr, "healthcheck: %v\n", err)
		os.Exit(1)
	}
}

// client talks to the service directly: no proxy from the environment, no redirects.
var client = &http.Client{
	Transport: &http.Transport{Proxy: nil, DisableKeepAlives: true},
	CheckRedirect: func(*http.Request, []*http.Request) error {
		return http.ErrUseLastResponse
	},
}

// check GETs url and returns nil only on HTTP 200. ctx bounds the whole exchange.
func check(ctx context.Context, url string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := client.Do(req)
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) {
			return fmt.Errorf("GET %s: no answer within the timeout", url)
		}
		return err
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if resp.StatusCode != http.StatusOK {
		if detail := problemDetail(resp.Header.Get("Content-Type"), body); detail != "" {
			return fmt.Errorf("GET %s: %s: %s", url, resp.Status, detail)
		}
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return nil
}

// maxDetail bounds the reason the line gives, in bytes: docker inspect keeps the healthcheck's
// output, and a reason is a few words.
const maxDetail = 200

// problemDetail is the detail of an RFC 9457 problem body (what /readyz answers 503 with: why
// the service is not ready), on one line and at most maxDetail bytes, or "" if body is none.
func problemDetail(contentType string, body []byte) string {
	mediaType, _, err := mime.ParseMediaType(contentType)
	if err != nil || mediaType != "application/problem+json" {
		return ""
	}
	var problem struct {
		Detail string `json:"detail"`
	}
	if json.Unmarshal(body, &problem) != nil {
		return ""
	}
	detail := strings.Join(strings.FieldsFunc(problem.Detail, func(r rune) bool {
		return unicode.IsSpace(r) || unicode.IsControl(r)
	}), " ")
	if len(detail) <= maxDetail {
		return detail
	}
	cut := maxDetail
	for cut > 0 && !utf8.RuneStart(detail[cut]) {
		cut--
	}
	return detail[:cut] + "…"
}
