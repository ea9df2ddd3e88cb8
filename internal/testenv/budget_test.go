package testenv

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestSlotsAreAllOrNothing(t *testing.T) {
	dir := t.TempDir()
	first, err := acquireSlots(dir, 5, 3, time.Second)
	if err != nil || len(first) != 3 {
		t.Fatalf("first reservation: %d slots, %v", len(first), err)
	}
	// 2 are free, 3 wanted: nothing is held while waiting, and it gives up at its deadline.
	if _, err := acquireSlots(dir, 5, 3, 200*time.Millisecond); err == nil {
		t.Fatal("3 of 5 slots reserved twice at once")
	}
	other, err := acquireSlots(dir, 5, 2, time.Second)
	if err != nil || len(other) != 2 {
		t.Fatalf("the 2 free slots: %d, %v (a waiter kept some?)", len(other), err)
	}
	other.release()

	got := make(chan error, 1)
	go func() {
		h, err := acquireSlots(dir, 5, 3, 10*time.Second)
		h.release()
		got <- err
	}()
	select {
	case err := <-got:
		t.Fatalf("second reservation of 3 did not wait for the first: %v", err)
	case <-time.After(300 * time.Millisecond):
	}
	first.release()
	if err := <-got; err != nil {
		t.Fatalf("second reservation after the first ended: %v", err)
	}
}

// A process that dies holding slots gives them back: the kernel drops its locks.
func TestSlotsOfAKilledProcessAreFree(t *testing.T) {
	if dir := os.Getenv("TESTENV_HOLD_SLOTS"); dir != "" {
		if _, err := acquireSlots(dir, 4, 4, time.Second); err != nil {
			fmt.Println(err)
			os.Exit(3)
		}
		fmt.Println("holding")
		time.Sleep(time.Minute)
		return
	}
	dir := t.TempDir()
	cmd := exec.Command(os.Args[0], "-test.run=^TestSlotsOfAKilledProcessAreFree$")
	cmd.Env = append(os.Environ(), "TESTENV_HOLD_SLOTS="+dir)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	holding := make(chan bool, 1)
	go func() {
		line, _ := bufio.NewReader(out).ReadString('\n')
		holding <- strings.TrimSpace(line) == "holding"
	}()
	select {
	case ok := <-holding:
		if !ok {
			t.Fatal("the child could not take the slots")
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the child did not take the slots within 30 s")
	}
	if _, err := acquireSlots(dir, 4, 1, 100*time.Millisecond); err == nil {
		t.Fatal("a slot the child holds was reserved again")
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	h, err := acquireSlots(dir, 4, 4, 5*time.Second)
	if err != nil {
		t.Fatalf("slots of the killed child: %v", err)
	}
	h.release()
}

// recorder is a testing.TB that records Fatalf and Skipf instead of ending the test, to check
// what the helpers refuse.
type recorder struct {
	testing.TB
	fatal, skip string
}

func (r *recorder) Fatalf(format string, args ...any) { r.fatal = fmt.Sprintf(format, args...) }
func (r *recorder) Skipf(format string, args ...any)  { r.skip = fmt.Sprintf(format, args...) }

func TestDrawingMoreThanReservedFails(t *testing.T) {
	r := &recorder{TB: t}
	reservationsMu.Lock()
	reservations[r] = &reservation{total: DefaultConnections}
	reservationsMu.Unlock()
	t.Cleanup(func() {
		reservationsMu.Lock()
		delete(reservations, r)
		reservationsMu.Unlock()
	})
	Draw(r, DefaultConnections)
	if r.fatal != "" {
		t.Fatalf("drawing exactly the reservation failed: %s", r.fatal)
	}
	Draw(r, 1)
	if !strings.Contains(r.fatal, "1 more PostgreSQL connections than the 11 it reserved") {
		t.Fatalf("drawing one more: %q, want a failure that says so", r.fatal)
	}
	r.fatal = ""
	Connections(r, 5)
	if !strings.Contains(r.fatal, "call it first") {
		t.Fatalf("Connections after drawing: %q, want a failure that says to call it first", r.fatal)
	}
}
