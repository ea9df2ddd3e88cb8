package testenv

import (
	"net"
	"testing"
)

// ServeEach is the address of a loopback listener that hands each connection it accepts to
// serve, and closes them all, and itself, at the test's end. serve runs on the accepting
// goroutine: one that holds its connection long starts a goroutine of its own.
func ServeEach(t *testing.T, serve func(conn net.Conn)) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { _ = conn.Close() })
			serve(conn)
		}
	}()
	return ln.Addr().String()
}
