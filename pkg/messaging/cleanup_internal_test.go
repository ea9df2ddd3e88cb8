package messaging

import (
	"bytes"
	"testing"
	"time"

	"github.com/google/uuid"
)

// uuidV7Bound(t) is above every UUIDv7 made up to t, and below those made a millisecond later.
func TestUUIDv7Bound(t *testing.T) {
	t.Parallel()
	for range 1000 {
		before := time.Now()
		id, err := uuid.NewV7()
		if err != nil {
			t.Fatal(err)
		}
		after := time.Now()
		if bound := uuidV7Bound(after); bytes.Compare(id[:], bound[:]) >= 0 {
			t.Fatalf("UUIDv7 %s made before %s is not below its bound %s", id, after, bound)
		}
		if earlier := uuidV7Bound(before.Add(-time.Millisecond)); bytes.Compare(id[:], earlier[:]) < 0 {
			t.Fatalf("UUIDv7 %s made after %s is below the bound %s of the millisecond before", id, before, earlier)
		}
	}
}
