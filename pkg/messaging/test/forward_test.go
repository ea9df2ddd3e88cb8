package test

import (
	"net"
	"testing"
)

// forward listens on a local port and hands each connection accepted there, with one dialled to
// upstream for it, to pair, which passes the traffic on in its own way (counting, stalling,
// dropping it). A client whose upstream cannot be dialled is closed. pair runs on the accepting
// goroutine, so it starts its copying in goroutines of its own and returns. The listener is
// closed at the test's end (closing it earlier stops the accepting); the connections handed to
// pair are pair's to close.
func forward(t *testing.T, upstream string, pair func(client, server net.Conn)) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			client, err := ln.Accept()
			if err != nil {
				return
			}
			server, err := net.Dial("tcp", upstream)
			if err != nil {
				_ = client.Close()
				continue
			}
			pair(client, server)
		}
	}()
	return ln
}
