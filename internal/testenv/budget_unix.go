//go:build unix

package testenv

import (
	"errors"
	"fmt"
	"os"
	"syscall"
)

// lockSlot opens path and locks it without waiting. flock locks belong to the open file, so
// two tests of one process exclude each other like two processes do.
func lockSlot(path string) (*os.File, bool, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o666)
	if err != nil {
		return nil, false, fmt.Errorf("open slot: %w", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		_ = f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, false, nil
		}
		return nil, false, fmt.Errorf("lock slot: %w", err)
	}
	return f, true, nil
}
