//go:build !unix

package testenv

import (
	"errors"
	"os"
)

// lockSlot needs flock; the suite's servers and admin tools are Unix-only anyway.
func lockSlot(string) (*os.File, bool, error) {
	return nil, false, errors.New("the PostgreSQL connection budget needs a Unix system")
}
