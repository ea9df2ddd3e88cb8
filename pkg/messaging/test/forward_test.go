package test

import (
	"encoding/binary"
	"io"
	"net"
	"sync"
	"testing"
)

// forward listens on a local port and hands each connection accepted there, with one dialled to
// upstream for it, to pair, which passes the traffic on in its own way (counting, stalling,
// dropping it). A client whose upstream cannot be dialled is closed. pair runs on the accepting
// goroutine, so it starts its copying in goroutines of its own and returns. At the test's end
// the listener is closed (closing it earlier stops the accepting), then the connections handed
// to pair, which pair may close earlier.
func forward(t *testing.T, upstream string, pair func(client, server net.Conn)) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	ended := false
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		defer mu.Unlock()
		ended = true
		for _, c := range conns {
			_ = c.Close()
		}
	})
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
			mu.Lock()
			if ended { // accepted as the test ended
				mu.Unlock()
				_, _ = client.Close(), server.Close()
				return
			}
			conns = append(conns, client, server)
			mu.Unlock()
			pair(client, server)
		}
	}()
	return ln
}

// copyThenClose copies src to dst until src ends (a client closing its connection, say), then
// closes dst.
func copyThenClose(dst io.WriteCloser, src io.Reader) {
	_, _ = io.Copy(dst, src)
	_ = dst.Close()
}

// frameHeaderLen is the length of an AMQP frame's header: its type, its channel (bytes 1-2) and
// its payload's size (bytes 3-6).
const frameHeaderLen = 7

// readFrame reads one whole AMQP frame from r: its header, its payload and its frame end.
func readFrame(r io.Reader) ([]byte, error) {
	header := make([]byte, frameHeaderLen)
	if _, err := io.ReadFull(r, header); err != nil {
		return nil, err
	}
	frame := make([]byte, frameHeaderLen+int(binary.BigEndian.Uint32(header[3:7]))+1) // and the frame end
	copy(frame, header)
	if _, err := io.ReadFull(r, frame[frameHeaderLen:]); err != nil {
		return nil, err
	}
	return frame, nil
}
