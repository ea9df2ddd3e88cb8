package platform

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"net"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outboxkit/outbox-inbox/internal/testenv"
)

// A connection pooler between the service and PostgreSQL that drops the startup parameters
// IndexPlansURL gives the sender's and the background pool stops the start with an error
// naming DATABASE_URL and the pool, where the pool would otherwise plan without them, unseen.
// The pooler is a proxy that takes enable_sort, enable_seqscan and jit out of each
// connection's startup message, and passes the rest; through one that takes nothing out,
// the same start succeeds.
func TestStartRefusesAPoolerThatDropsThePlanSettings(t *testing.T) {
	t.Parallel()
	planSettings := []string{"enable_sort", "enable_seqscan", "jit"}
	for _, tc := range []struct {
		name  string
		pools Pools
		drop  []string
		want  string // "" for a start that succeeds
	}{
		{"the sender's pool", Pools{Sender: 1}, planSettings, "DATABASE_URL: the sessions of the sender's pool have enable_sort, enable_seqscan and jit"},
		{"the background pool", Pools{Background: 1}, planSettings, "DATABASE_URL: the sessions of the background pool have enable_sort, enable_seqscan and jit"},
		{"both, through a proxy that drops nothing", Pools{Sender: 1, Background: 1}, nil, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			conns := ReadinessConns + tc.pools.Background + tc.pools.Sender + MinRequestConns
			testenv.Connections(t, 2+conns) // the database's creation and its handle, the service
			d := testenv.NewDatabaseWithPool(t, 1)
			proxy := startupStrippingProxy(t, testenv.DatabaseHost(t), tc.drop...)
			log, _ := testenv.NewLogger(t)
			c := Common{DatabaseURL: testenv.URLVia(t, d.URL, proxy), DBMaxConns: conns}
			b, err := Start(context.Background(), log, "svc", c, tc.pools)
			if err == nil {
				b.Close()
			}
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("Start through the proxy: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("Start through a proxy that drops %v: %v; want %q", tc.drop, err, tc.want)
			}
		})
	}
}

// startupStrippingProxy relays each connection to upstream, a PostgreSQL server, without the
// parameters drop names in its startup message, as a connection pooler that passes no startup
// parameter but a few does, and answers N (no) to a request for TLS or GSS encryption, as a
// plain server does. It returns its address, and stops with t.
func startupStrippingProxy(t *testing.T, upstream string, drop ...string) string {
	t.Helper()
	return testenv.ServeEach(t, func(client net.Conn) { go relayStripped(client, upstream, drop) })
}

// Codes of the messages a client may open with, instead of a protocol version.
const (
	sslRequestCode    = 80877103
	gssEncRequestCode = 80877104
)

// readStartup reads client's startup message: its protocol version, and its parameters. It
// answers N (no) to a request for TLS or GSS encryption before it, as a plain server does. ok
// is false if the client closed first, or sent what no client starts with.
func readStartup(client net.Conn) (version, params []byte, ok bool) {
	for {
		var head [8]byte
		if _, err := io.ReadFull(client, head[:]); err != nil {
			return nil, nil, false
		}
		size := binary.BigEndian.Uint32(head[:4])
		if size < 8 || size > 10000 {
			return nil, nil, false
		}
		body := make([]byte, size-8)
		if _, err := io.ReadFull(client, body); err != nil {
			return nil, nil, false
		}
		switch binary.BigEndian.Uint32(head[4:]) {
		case sslRequestCode, gssEncRequestCode:
			if _, err := client.Write([]byte{'N'}); err != nil {
				return nil, nil, false
			}
		default:
			return head[4:8:8], body, true
		}
	}
}

// relayStripped relays client to upstream, its startup message without the parameters drop
// names, until either side closes. A client that fails to start is closed: its error is the
// test's.
func relayStripped(client net.Conn, upstream string, drop []string) {
	version, params, ok := readStartup(client)
	if !ok {
		_ = client.Close()
		return
	}
	relay(client, upstream, slices.Concat(version, stripParams(params, drop)))
}

// relay sends upstream startup, a startup message's protocol version and parameters, then
// relays client to upstream and back until either side closes, and closes client.
func relay(client net.Conn, upstream string, startup []byte) {
	defer client.Close()
	server, err := net.Dial("tcp", upstream)
	if err != nil {
		return
	}
	defer server.Close()
	msg := binary.BigEndian.AppendUint32(nil, uint32(4+len(startup)))
	if _, err := server.Write(append(msg, startup...)); err != nil {
		return
	}
	go func() {
		_, _ = io.Copy(server, client)
		_ = server.Close()
	}()
	_, _ = io.Copy(client, server)
}

// stripParams is body, a startup message's parameters (name and value, each ending in a zero
// byte, and a zero byte after the last pair), without those named in drop.
func stripParams(body []byte, drop []string) []byte {
	fields := bytes.Split(bytes.TrimSuffix(body, []byte{0, 0}), []byte{0})
	var kept []byte
	for i := 0; i+1 < len(fields); i += 2 {
		if !slices.Contains(drop, string(fields[i])) {
			kept = append(append(append(append(kept, fields[i]...), 0), fields[i+1]...), 0)
		}
	}
	return append(kept, 0)
}

// A start whose background pool's first connection is refused, in a way that passes, waits the
// refusals out as its other pools do, saying so in the log, and starts once they stop: the
// server starting up after a failover (57P03), its connections all taken (53300), a connection
// closed unanswered during a restart. pgxpool connects at its first statement, the check of its
// plan settings, which failed the start at the first refusal: an exit 1, and the orchestrator's
// restart back-off after the refusals had stopped. The proxy passes the requests' pool's
// login, refuses the refusals logins after it, and passes the rest (a login: a connection's
// startup message; a connection that asks for TLS and is told no logs in on the next).
func TestStartWaitsForTheBackgroundPoolsFirstConnection(t *testing.T) {
	t.Parallel()
	const refusals = 2
	for _, tc := range []struct {
		name          string
		code, message string // "": the login is left unanswered, its connection closed
		logged        string
	}{
		{"the database starting up", "57P03", "the database system is starting up", "SQLSTATE 57P03"},
		{"too many connections", "53300", "sorry, too many clients already", "SQLSTATE 53300"},
		{"the connection dropped", "", "", "EOF"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			pools := Pools{Background: 1}
			conns := ReadinessConns + pools.Background + MinRequestConns
			testenv.Connections(t, 2+conns) // the database's creation and its handle, the service
			d := testenv.NewDatabaseWithPool(t, 1)
			upstream := testenv.DatabaseHost(t)
			var logins, refused atomic.Int32
			proxy := testenv.ServeEach(t, func(client net.Conn) {
				go func() {
					version, params, ok := readStartup(client)
					if !ok {
						_ = client.Close()
						return
					}
					if n := logins.Add(1); n > 1 && n <= 1+refusals {
						refused.Add(1)
						refuseLogin(client, tc.code, tc.message)
						return
					}
					relay(client, upstream, slices.Concat(version, params))
				}()
			})
			log, logs := testenv.NewLogger(t)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			c := Common{DatabaseURL: testenv.URLVia(t, d.URL, proxy), DBMaxConns: conns}
			b, err := Start(ctx, log, "svc", c, pools)
			if err != nil {
				t.Fatalf("Start with the %d logins after the requests' pool's refused (%s): %v; want it to wait them out", refusals, tc.name, err)
			}
			b.Close()
			if n := refused.Load(); n != refusals {
				t.Fatalf("Start went through %d refused logins, want %d", n, refusals)
			}
			if len(logs.Lines("waiting for the database", "pool=svc-background", tc.logged)) == 0 {
				t.Fatalf("no line of the wait with %q in the log:\n%s", tc.logged, logs)
			}
		})
	}
}

// refuseLogin answers client's startup message with a FATAL error of code and message, as
// PostgreSQL refuses a login, and closes it; closes it without an answer if code is "".
func refuseLogin(client net.Conn, code, message string) {
	defer client.Close()
	if code == "" {
		return
	}
	var fields []byte
	for _, f := range []struct {
		kind  byte
		value string
	}{{'S', "FATAL"}, {'V', "FATAL"}, {'C', code}, {'M', message}} {
		fields = append(append(append(fields, f.kind), f.value...), 0)
	}
	fields = append(fields, 0)
	msg := binary.BigEndian.AppendUint32([]byte{'E'}, uint32(4+len(fields)))
	_, _ = client.Write(append(msg, fields...))
}
