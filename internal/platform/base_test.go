package platform

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"net"
	"slices"
	"strings"
	"testing"

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

// relayStripped relays client to upstream, its startup message without the parameters drop
// names, until either side closes. A client that fails to start is closed: its error is the
// test's.
func relayStripped(client net.Conn, upstream string, drop []string) {
	defer client.Close()
	var startup []byte
	for startup == nil {
		var head [8]byte
		if _, err := io.ReadFull(client, head[:]); err != nil {
			return
		}
		size := binary.BigEndian.Uint32(head[:4])
		if size < 8 || size > 10000 {
			return
		}
		body := make([]byte, size-8)
		if _, err := io.ReadFull(client, body); err != nil {
			return
		}
		switch binary.BigEndian.Uint32(head[4:]) {
		case sslRequestCode, gssEncRequestCode:
			if _, err := client.Write([]byte{'N'}); err != nil {
				return
			}
		default:
			startup = append(head[4:8:8], stripParams(body, drop)...)
		}
	}
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
