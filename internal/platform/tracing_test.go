package platform

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math/big"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/trace"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// Without OTEL_EXPORTER_OTLP_ENDPOINT, spans still get trace ids but go nowhere, even when the
// signal-specific variable the exporter would read points at a receiver; with it, they reach
// the receiver it names, tagged with the service's name.
func TestSpansAreExportedOnlyWhenTheOTLPEndpointIsSet(t *testing.T) {
	receiver := testenv.NewOTLPReceiver(t)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))

	t.Setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.URL+"/v1/traces")
	env := EnvFrom(map[string]string{})
	tp, err := startTracing(context.Background(), log, "order", readOTLPEndpoint(env) != "")
	if err != nil {
		t.Fatal(err)
	}
	_, span := otel.Tracer("test").Start(context.Background(), "unexported")
	span.End()
	stopTracing(log, tp)
	if sc := span.SpanContext(); !sc.IsValid() || !sc.IsSampled() {
		t.Fatalf("span context %+v without an endpoint, want a valid sampled one: log lines need its trace id", sc)
	}
	if n := receiver.Posts(); n != 0 {
		t.Fatalf("%d exports without OTEL_EXPORTER_OTLP_ENDPOINT, want none", n)
	}

	t.Setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
	env = EnvFrom(map[string]string{OTLPEndpointVariable: receiver.URL})
	t.Setenv(OTLPEndpointVariable, receiver.URL) // the exporter reads the process's environment
	tp, err = startTracing(context.Background(), log, "order", readOTLPEndpoint(env) != "")
	if err != nil || env.Err() != nil {
		t.Fatal(err, env.Err())
	}
	_, span = otel.Tracer("test").Start(context.Background(), "exported")
	span.End()
	stopTracing(log, tp) // flushes
	got := receiver.Trace(span.SpanContext().TraceID().String())
	if len(got) != 1 || got[0].Name != "exported" || got[0].Service != "order" {
		t.Fatalf("received %+v, want the span, from service order", got)
	}
}

func TestOTLPEndpointMustBeAnHTTPURL(t *testing.T) {
	t.Parallel()
	for _, v := range []string{"jaeger:4318", "grpc://jaeger:4317", "http://"} {
		env := EnvFrom(map[string]string{OTLPEndpointVariable: v})
		readOTLPEndpoint(env)
		if err := env.Err(); err == nil || !strings.Contains(err.Error(), OTLPEndpointVariable+": must be an http or https URL") {
			t.Errorf("%s=%q: %v, want it refused by name", OTLPEndpointVariable, v, err)
		}
	}
}

var traceIDField = regexp.MustCompile(`trace_id=([0-9a-f]{32}) span_id=([0-9a-f]{16})`)

// A request runs in a server span that continues the caller's traceparent, or starts a trace;
// the handler's log lines carry its trace id. (Not parallel: it installs the global provider.)
func TestRequestsRunInAServerSpanThatTheirLogLinesName(t *testing.T) {
	var logs bytes.Buffer
	log := NewLogger(&logs, "order", "text", "info")
	tp, err := startTracing(context.Background(), log, "order", false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { stopTracing(log, tp) })
	var handled trace.SpanContext
	router := NewRouter(log, prometheus.NewRegistry(), func(context.Context) error { return nil })
	router.Get("/things/{id}", func(w http.ResponseWriter, r *http.Request) {
		handled = trace.SpanContextFromContext(r.Context())
		log.InfoContext(r.Context(), "thing shown")
		w.WriteHeader(http.StatusNoContent)
	})
	srv := httptest.NewServer(router)
	t.Cleanup(srv.Close)
	get := func(header string) {
		t.Helper()
		req, err := http.NewRequest(http.MethodGet, srv.URL+"/things/7", nil)
		if err != nil {
			t.Fatal(err)
		}
		if header != "" {
			req.Header.Set("traceparent", header)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusNoContent {
			t.Fatalf("GET = %d", resp.StatusCode)
		}
	}

	const caller = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	get(caller)
	if handled.TraceID().String() != "4bf92f3577b34da6a3ce929d0e0e4736" || handled.SpanID().String() == "00f067aa0ba902b7" || handled.IsRemote() {
		t.Fatalf("the handler ran in %s/%s (remote %v), want a span of its own in the caller's trace", handled.TraceID(), handled.SpanID(), handled.IsRemote())
	}
	m := traceIDField.FindStringSubmatch(logs.String())
	if len(m) < 3 || m[1] != handled.TraceID().String() || m[2] != handled.SpanID().String() {
		t.Fatalf("log %q, want trace_id=%s span_id=%s", logs.String(), handled.TraceID(), handled.SpanID())
	}

	logs.Reset()
	get("")
	if !handled.IsValid() || handled.TraceID().String() == "4bf92f3577b34da6a3ce929d0e0e4736" {
		t.Fatalf("a request without traceparent ran in %+v, want a trace of its own", handled)
	}
	if m := traceIDField.FindStringSubmatch(logs.String()); len(m) < 2 || m[1] != handled.TraceID().String() {
		t.Fatalf("log %q, want trace_id=%s", logs.String(), handled.TraceID())
	}
}

// A public client's request brings its trace context in, but not its baggage, nor a tracestate
// longer than 512 characters: the messages the request leads to would carry them downstream.
// A short tracestate is kept. (Not parallel: it installs the global propagator, which reads
// and writes baggage.)
func TestAClientsBaggageAndLongTraceStateStayAtTheEdge(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	tp, err := startTracing(context.Background(), log, "order", false)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { stopTracing(log, tp) })
	var (
		handled trace.SpanContext
		bag     baggage.Baggage
		message messaging.Message
	)
	router := NewRouter(log, prometheus.NewRegistry(), func(context.Context) error { return nil })
	router.Post("/orders", func(w http.ResponseWriter, r *http.Request) {
		handled, bag = trace.SpanContextFromContext(r.Context()), baggage.FromContext(r.Context())
		message = messaging.Message{}.WithTrace(r.Context())
		w.WriteHeader(http.StatusCreated)
	})
	const caller = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	long := make([]string, 32)
	for i := range long {
		long[i] = fmt.Sprintf("k%d=%s", i, strings.Repeat("v", 250))
	}
	for state, kept := range map[string]bool{"vendor=abc": true, strings.Join(long, ","): false} {
		req := httptest.NewRequest(http.MethodPost, "/orders", nil)
		req.Header.Set("traceparent", caller)
		req.Header.Set("tracestate", state)
		req.Header.Set("baggage", "customer=hunter2,"+strings.Repeat("x", 4000)+"=y")
		rec := httptest.NewRecorder()
		router.ServeHTTP(rec, req)
		if rec.Code != http.StatusCreated {
			t.Fatalf("POST = %d", rec.Code)
		}
		if handled.TraceID().String() != "4bf92f3577b34da6a3ce929d0e0e4736" {
			t.Errorf("the handler ran in trace %s, want the caller's", handled.TraceID())
		}
		if bag.Len() != 0 {
			t.Errorf("the handler's context carries the client's baggage %q, want none", bag.String())
		}
		if _, ok := message.Headers["baggage"]; ok || strings.Contains(fmt.Sprint(message), "hunter2") {
			t.Errorf("a message the request enqueues carries the client's baggage, its headers %v", slices.Collect(maps.Keys(message.Headers)))
		}
		if want := map[bool]string{true: state, false: ""}[kept]; handled.TraceState().String() != want || message.TraceState != want {
			t.Errorf("tracestate of %d characters: the span has %d, the message %d; want %d", len(state), len(handled.TraceState().String()), len(message.TraceState), len(want))
		}
	}
}

// A line logged without a span in its context has no trace fields, and the fields follow the
// logger's own attributes.
func TestLogLinesOutsideATraceHaveNoTraceID(t *testing.T) {
	t.Parallel()
	var logs bytes.Buffer
	log := NewLogger(&logs, "order", "text", "info").With("component", "relay")
	log.Info("starting")
	log.InfoContext(trace.ContextWithSpanContext(context.Background(), trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{1}, SpanID: trace.SpanID{2},
	})), "one message", "n", 1)
	lines := strings.Split(strings.TrimSpace(logs.String()), "\n")
	if len(lines) != 2 || strings.Contains(lines[0], "trace_id") ||
		!strings.HasSuffix(lines[1], "service=order component=relay n=1 trace_id=01000000000000000000000000000000 span_id=0200000000000000") {
		t.Fatalf("lines %q", lines)
	}
}

// OTEL_RESOURCE_ATTRIBUTES is checked with the configuration: a value the tracer provider's
// resource would fail on (a pair without its "=", a trailing comma), or would keep as written
// with a line on stderr (a value's bad percent-escape), stops the service with an error naming
// the variable, before its start line, and a value it takes starts tracing. Not
// parallel: the SDK reads the variable from the process's environment.
func TestResourceAttributesAreCheckedWithTheConfiguration(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	for value, valid := range map[string]bool{
		"":                             true,
		"deployment.environment=prod":  true,
		"a=b, c = d,e=":                true,
		"deployment.environment=prod,": false,
		"deployment.environment":       false,
		"a=b,,c=d":                     false,
		"=prod":                        false,
		"team=50%25":                   true,
		"team=50%zz":                   false,
		"team=50%":                     false,
	} {
		err := readCommonWith("OTEL_RESOURCE_ATTRIBUTES", value)
		if valid != (err == nil) || (err != nil && !strings.Contains(err.Error(), "OTEL_RESOURCE_ATTRIBUTES: ")) {
			t.Errorf("OTEL_RESOURCE_ATTRIBUTES=%q: %v; want it taken: %v, or else an error naming the variable", value, err, valid)
		}
		if !valid {
			continue
		}
		t.Setenv("OTEL_RESOURCE_ATTRIBUTES", value)
		tp, err := startTracing(context.Background(), log, "order", false)
		if err != nil {
			t.Errorf("OTEL_RESOURCE_ATTRIBUTES=%q, taken by the configuration: tracing did not start: %v", value, err)
			continue
		}
		stopTracing(log, tp)
	}
}

// The exporter's own variables that it would ignore when bad, starting without them, stop the
// service at start instead, with an error naming the variable: a timeout not in whole
// milliseconds, a compression other than gzip or none, a TLS file it cannot read or parse, a
// client certificate without its key, a header entry its parser drops, a protocol other than
// OTLP/HTTP's (grpc was sent as http/protobuf), an _INSECURE that is no boolean or that the
// endpoint's scheme contradicts (true with https posted the headers' credentials in cleartext;
// false with http spoke TLS to a plain port); and so do the batch span processor's, which
// would otherwise fall back to their defaults (5s), spin (a delay of 0), or panic (a negative
// queue or batch). No error quotes a header's value. They are checked only with an endpoint:
// without one, neither the exporter nor the processor reads them.
func TestOTLPExporterVariablesItWouldIgnoreAreRefused(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	cert, key := writeCertificate(t, dir)
	missing := filepath.Join(dir, "missing.pem")
	for _, tc := range []struct {
		vars map[string]string
		want string // "" for taken
	}{
		{map[string]string{"OTEL_EXPORTER_OTLP_TIMEOUT": "10000"}, ""},
		{map[string]string{"OTEL_EXPORTER_OTLP_TIMEOUT": "5s"}, "OTEL_EXPORTER_OTLP_TIMEOUT: must be a whole number of milliseconds"},
		{map[string]string{"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "-1"}, "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT: must be a whole number of milliseconds"},
		{map[string]string{"OTEL_EXPORTER_OTLP_TIMEOUT": "0"}, "OTEL_EXPORTER_OTLP_TIMEOUT: must be a whole number of milliseconds, 1 to 3600000"},
		{map[string]string{"OTEL_EXPORTER_OTLP_TIMEOUT": "3600001"}, "OTEL_EXPORTER_OTLP_TIMEOUT: must be a whole number of milliseconds, 1 to 3600000"},
		{map[string]string{"OTEL_EXPORTER_OTLP_COMPRESSION": "gzip", "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "none"}, ""},
		{map[string]string{"OTEL_EXPORTER_OTLP_COMPRESSION": "GZIP"}, "OTEL_EXPORTER_OTLP_COMPRESSION: must be gzip or none"},
		{map[string]string{"OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "zstd"}, "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION: must be gzip or none"},
		{map[string]string{"OTEL_EXPORTER_OTLP_CERTIFICATE": cert, "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE": cert}, ""},
		{map[string]string{"OTEL_EXPORTER_OTLP_CERTIFICATE": missing}, "OTEL_EXPORTER_OTLP_CERTIFICATE: open " + missing},
		{map[string]string{"OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE": key}, "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE: must be a file of PEM certificates"},
		{map[string]string{"OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": cert, "OTEL_EXPORTER_OTLP_CLIENT_KEY": key}, ""},
		{map[string]string{"OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": cert}, "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE, OTEL_EXPORTER_OTLP_CLIENT_KEY: must be set together"},
		{map[string]string{"OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": cert, "OTEL_EXPORTER_OTLP_CLIENT_KEY": missing}, "OTEL_EXPORTER_OTLP_CLIENT_KEY: open " + missing},
		{map[string]string{"OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY": key}, "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE, OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY: must be set together"},
		{map[string]string{"OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE": key, "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY": cert}, "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE, OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY: tls: "},
		{map[string]string{"OTEL_EXPORTER_OTLP_HEADERS": "Authorization=Bearer%20hunter2, X-Tenant = shop", "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "a=b=c,d="}, ""},
		{map[string]string{"OTEL_EXPORTER_OTLP_HEADERS": "Authorization: Bearer hunter2"}, "OTEL_EXPORTER_OTLP_HEADERS: entry 1 of 1 is not key=value"},
		{map[string]string{"OTEL_EXPORTER_OTLP_TRACES_HEADERS": "Authorization=Bearer%20hunter2,"}, "OTEL_EXPORTER_OTLP_TRACES_HEADERS: entry 2 of 2 is not key=value"},
		{map[string]string{"OTEL_EXPORTER_OTLP_HEADERS": "X-Tenant=shop,Bearer hunter2=x"}, "OTEL_EXPORTER_OTLP_HEADERS: entry 2 of 2: its key is not a header name"},
		{map[string]string{"OTEL_EXPORTER_OTLP_HEADERS": "Authorization=Bearer%zzhunter2"}, "OTEL_EXPORTER_OTLP_HEADERS: entry 1 of 1 (Authorization): its value is not percent-encoded"},
		{map[string]string{"OTEL_EXPORTER_OTLP_TRACES_HEADERS": "Authorization=hunter2%0Ax"}, "OTEL_EXPORTER_OTLP_TRACES_HEADERS: entry 1 of 1 (Authorization): its value holds a character"},
		{map[string]string{"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}, ""},
		{map[string]string{"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "OTEL_EXPORTER_OTLP_PROTOCOL: must be http/protobuf or http/json: spans are exported over OTLP/HTTP only"},
		{map[string]string{"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "HTTP/JSON"}, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: must be http/protobuf or http/json"},
		{map[string]string{"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http"}, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: must be http/protobuf or http/json"},
		// The exporter reads the traces' form over the other, which it never reads then.
		{map[string]string{"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}, ""},
		{map[string]string{"OTEL_EXPORTER_OTLP_INSECURE": "yes", "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "false"}, ""},
		{map[string]string{OTLPEndpointVariable: "http://jaeger:4318", "OTEL_EXPORTER_OTLP_INSECURE": "TRUE"}, ""},
		{map[string]string{"OTEL_EXPORTER_OTLP_INSECURE": "false", "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "False"}, ""},
		{map[string]string{"OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "false"}, ""}, // the traces' form wins, as in the exporter
		{map[string]string{"OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_EXPORTER_OTLP_HEADERS": "Authorization=Bearer%20hunter2"}, "OTEL_EXPORTER_OTLP_INSECURE: is true, with which the exporter posts to the https endpoint in plain HTTP, OTEL_EXPORTER_OTLP_HEADERS' credentials in cleartext"},
		{map[string]string{"OTEL_EXPORTER_OTLP_INSECURE": "false", "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "true"}, "OTEL_EXPORTER_OTLP_TRACES_INSECURE: is true, with which the exporter posts to the https endpoint in plain HTTP"},
		{map[string]string{OTLPEndpointVariable: "http://jaeger:4318", "OTEL_EXPORTER_OTLP_INSECURE": "false"}, "OTEL_EXPORTER_OTLP_INSECURE: is false, with which the exporter speaks TLS to the http endpoint"},
		{map[string]string{"OTEL_EXPORTER_OTLP_INSECURE": "yes"}, "OTEL_EXPORTER_OTLP_INSECURE: must be true or false: the exporter takes any other value for false"},
		{map[string]string{OTLPEndpointVariable: "http://jaeger:4318", "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "1"}, "OTEL_EXPORTER_OTLP_TRACES_INSECURE: must be true or false"},
		{map[string]string{"OTEL_BSP_SCHEDULE_DELAY": "1", "OTEL_BSP_EXPORT_TIMEOUT": "0", "OTEL_BSP_MAX_QUEUE_SIZE": "1", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "1"}, ""},
		{map[string]string{"OTEL_BSP_MAX_QUEUE_SIZE": "4096", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "4096"}, ""},
		{map[string]string{"OTEL_BSP_SCHEDULE_DELAY": "5s"}, "OTEL_BSP_SCHEDULE_DELAY: must be a whole number of milliseconds from 1 to 3600000"},
		{map[string]string{"OTEL_BSP_SCHEDULE_DELAY": "0"}, "OTEL_BSP_SCHEDULE_DELAY: must be a whole number of milliseconds from 1 to 3600000"},
		{map[string]string{"OTEL_BSP_SCHEDULE_DELAY": " 5000"}, "OTEL_BSP_SCHEDULE_DELAY: must be a whole number of milliseconds from 1 to 3600000, without spaces"},
		{map[string]string{"OTEL_BSP_EXPORT_TIMEOUT": "-1"}, "OTEL_BSP_EXPORT_TIMEOUT: must be a whole number of milliseconds from 0 to 3600000"},
		{map[string]string{"OTEL_BSP_EXPORT_TIMEOUT": "30s"}, "OTEL_BSP_EXPORT_TIMEOUT: must be a whole number of milliseconds from 0 to 3600000"},
		{map[string]string{"OTEL_BSP_MAX_QUEUE_SIZE": "-3"}, "OTEL_BSP_MAX_QUEUE_SIZE: must be a whole number of spans from 1 to 1000000"},
		{map[string]string{"OTEL_BSP_MAX_QUEUE_SIZE": "0"}, "OTEL_BSP_MAX_QUEUE_SIZE: must be a whole number of spans from 1 to 1000000"},
		{map[string]string{"OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "-1"}, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE: must be a whole number of spans from 1 to 1000000"},
		{map[string]string{"OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "0"}, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE: must be a whole number of spans from 1 to 1000000"},
		{map[string]string{"OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "4096"}, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE: must be at most OTEL_BSP_MAX_QUEUE_SIZE (2048 unless set)"},
		{map[string]string{"OTEL_BSP_MAX_QUEUE_SIZE": "100", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "200"}, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE: must be at most OTEL_BSP_MAX_QUEUE_SIZE"},
	} {
		vars := map[string]string{OTLPEndpointVariable: "https://collector:4318"}
		maps.Copy(vars, tc.vars)
		env := EnvFrom(vars)
		readOTLPEndpoint(env)
		switch err := env.Err(); {
		case tc.want == "" && err != nil:
			t.Errorf("%v: %v, want them taken", tc.vars, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "hunter2")):
			t.Errorf("%v: %v, want %q, and no header's value", tc.vars, err, tc.want)
		}
		vars = maps.Clone(tc.vars)
		delete(vars, OTLPEndpointVariable)
		env = EnvFrom(vars)
		readOTLPEndpoint(env)
		if err := env.Err(); err != nil {
			t.Errorf("%v without %s: %v, want them unread", vars, OTLPEndpointVariable, err)
		}
	}
}

// The batch span processor starts, and exports, with the least of what the configuration
// takes: a queue and a batch of one span, a delay of a millisecond, and no export timeout of its
// own. (Not parallel: the SDK reads the variables from the process's environment.)
func TestTheBatchSpanProcessorStartsWithTheLeastTaken(t *testing.T) {
	receiver := testenv.NewOTLPReceiver(t)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	vars := map[string]string{
		OTLPEndpointVariable: receiver.URL, "OTEL_BSP_MAX_QUEUE_SIZE": "1", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "1",
		"OTEL_BSP_SCHEDULE_DELAY": "1", "OTEL_BSP_EXPORT_TIMEOUT": "0",
	}
	env := EnvFrom(vars)
	export := readOTLPEndpoint(env) != ""
	if err := env.Err(); err != nil || !export {
		t.Fatalf("%v: %v, want them taken", vars, err)
	}
	for k, v := range vars {
		t.Setenv(k, v)
	}
	tp, err := startTracing(context.Background(), log, "order", export)
	if err != nil {
		t.Fatal(err)
	}
	_, span := otel.Tracer("test").Start(context.Background(), "exported")
	span.End()
	testenv.Eventually(t, 5*time.Second, func() bool { return len(receiver.Trace(span.SpanContext().TraceID().String())) == 1 },
		"the span was not exported within the millisecond's delay")
	stopTracing(log, tp)
}

// writeCertificate writes a self-signed certificate and its key, PEM-encoded, into dir, and
// returns their paths.
func writeCertificate(t *testing.T, dir string) (cert, key string) {
	t.Helper()
	priv, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "collector"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &priv.PublicKey, priv)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(priv)
	if err != nil {
		t.Fatal(err)
	}
	cert, key = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	for path, block := range map[string]*pem.Block{cert: {Type: "CERTIFICATE", Bytes: der}, key: {Type: "PRIVATE KEY", Bytes: keyDER}} {
		if err := os.WriteFile(path, pem.EncodeToMemory(block), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return cert, key
}
