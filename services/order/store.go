package main

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"embed"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"gorm.io/gorm"
	"gorm.io/gorm/clause"

	"github.com/outboxkit/outbox-inbox/internal/events"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// Migrations are the order database's own tables; outbox_messages comes from pkg/messaging.
//
//go:embed migrations/*.sql
var migrations embed.FS

var (
	ErrNotFound            = errors.New("order not found")
	ErrIdempotencyConflict = errors.New("idempotency key already used for a different order")
)

type orderRow struct {
	ID             uuid.UUID `gorm:"type:uuid;primaryKey"`
	CustomerID     string
	TotalCents     int64
	Status         string
	CreatedAt      time.Time
	CancelledAt    *time.Time
	CancelReason   *string
	IdempotencyKey *string
	RequestHash    *string
}

func (orderRow) TableName() string { return "orders" }

type lineRow struct {
	OrderID        uuid.UUID `gorm:"type:uuid;primaryKey"`
	LineNo         int       `gorm:"primaryKey"`
	SKU            string    `gorm:"column:sku"`
	Quantity       int64
	UnitPriceCents int64
}

func (lineRow) TableName() string { return "order_lines" }

// Store keeps orders. Placing one writes the order, its lines and its OrderPlaced outbox
// message in one transaction: no broker call, so no dual write.
type Store struct {
	db     *gorm.DB
	driver messaging.Driver[*gorm.DB]
}

// readCommitted is the isolation the store's transactions ask for, whatever the database's
// default: a request that waits on another's idempotency key, or on another's cancel, must see
// the row committed meanwhile, not fail to serialize.
var readCommitted = &sql.TxOptions{Isolation: sql.LevelReadCommitted}

// Place saves a new order from cmd, or, when key was used before with the same command,
// returns that first order with replayed=true and writes nothing.
func (s *Store) Place(ctx context.Context, cmd PlaceOrder, key string) (order Order, replayed bool, err error) {
	hash, err := commandHash(cmd)
	if err != nil {
		return Order{}, false, err
	}
	id, err := uuid.NewV7()
	if err != nil {
		return Order{}, false, fmt.Errorf("new order id: %w", err)
	}
	order = NewOrder(cmd, id, time.Now())

	err = s.db.WithContext(ctx).Transaction(func(tx *gorm.DB) error {
		row := orderRow{ID: order.ID, CustomerID: order.CustomerID, TotalCents: order.TotalCents, Status: order.Status, CreatedAt: order.CreatedAt}
		if key != "" {
			row.IdempotencyKey, row.RequestHash = &key, &hash
		}
		// With a key, a concurrent request with the same key waits here for the first to
		// commit, then inserts nothing: the unique key decides, not a check before the insert.
		res := tx.Clauses(clause.OnConflict{Columns: []clause.Column{{Name: "idempotency_key"}}, DoNothing: true}).Create(&row)
		if res.Error != nil {
			return fmt.Errorf("insert order: %w", res.Error)
		}
		if res.RowsAffected == 0 {
			replayed = true
			order, err = keyed(tx, key, hash)
			return err
		}
		lines := make([]lineRow, len(order.Lines))
		for i, l := range order.Lines {
			lines[i] = lineRow{OrderID: order.ID, LineNo: i + 1, SKU: l.SKU, Quantity: l.Quantity, UnitPriceCents: l.UnitPriceCents}
		}
		if err := tx.Create(&lines).Error; err != nil {
			return fmt.Errorf("insert order lines: %w", err)
		}
		msg, err := events.OrderPlacedEvent.Message(order.Placed())
		if err != nil {
			return err
		}
		msg.OccurredAt, msg.CorrelationID = order.CreatedAt, order.ID.String()
		return messaging.Enqueue(ctx, s.driver, tx, msg)
	}, readCommitted)
	if err != nil {
		return Order{}, false, err
	}
	return order, replayed, nil
}

// Replay returns the order key placed, if it placed it from cmd, and commits nothing:
// ErrNotFound if key placed no order, ErrIdempotencyConflict if it placed another command's.
// A request with key still uncommitted (the first, at work on another replica) is waited for,
// as Place waits: a plain read would not see its order, and answer that key placed none just
// before it does. So Replay inserts a row with key, which waits on the unique key for that
// request to end, and rolls it back if it went in: then no order has key.
func (s *Store) Replay(ctx context.Context, cmd PlaceOrder, key string) (order Order, err error) {
	hash, err := commandHash(cmd)
	if err != nil {
		return Order{}, err
	}
	id, err := uuid.NewV7()
	if err != nil {
		return Order{}, fmt.Errorf("new order id: %w", err)
	}
	err = s.db.WithContext(ctx).Transaction(func(tx *gorm.DB) error {
		probe := orderRow{ID: id, Status: StatusPlaced, CreatedAt: time.Now(), IdempotencyKey: &key, RequestHash: &hash}
		res := tx.Clauses(clause.OnConflict{Columns: []clause.Column{{Name: "idempotency_key"}}, DoNothing: true}).Create(&probe)
		switch {
		case res.Error != nil:
			return fmt.Errorf("wait for the order of idempotency key: %w", res.Error)
		case res.RowsAffected > 0:
			return ErrNotFound // and the row is rolled back
		}
		order, err = keyed(tx, key, hash)
		return err
	}, readCommitted)
	if err != nil {
		return Order{}, err
	}
	return order, nil
}

// keyed returns the order placed with key from the command of hash: ErrNotFound if key placed
// none, ErrIdempotencyConflict if it placed another command's.
func keyed(db *gorm.DB, key, hash string) (Order, error) {
	var first orderRow
	if err := db.Where("idempotency_key = ?", key).Take(&first).Error; err != nil {
		if errors.Is(err, gorm.ErrRecordNotFound) {
			return Order{}, ErrNotFound
		}
		return Order{}, fmt.Errorf("load order of idempotency key: %w", err)
	}
	if first.RequestHash == nil || *first.RequestHash != hash {
		return Order{}, ErrIdempotencyConflict
	}
	return load(db, first)
}

// Cancel cancels the order id: its new status and its OrderCancelled event are written in one
// transaction. The order's row is locked first, so two cancels at once write one event; an
// order cancelled before is returned as it is, with changed=false.
func (s *Store) Cancel(ctx context.Context, id uuid.UUID, cmd CancelOrder) (order Order, changed bool, err error) {
	err = s.db.WithContext(ctx).Transaction(func(tx *gorm.DB) error {
		var row orderRow
		if err := tx.Clauses(clause.Locking{Strength: "UPDATE"}).Take(&row, "id = ?", id).Error; err != nil {
			if errors.Is(err, gorm.ErrRecordNotFound) {
				return ErrNotFound
			}
			return fmt.Errorf("lock order: %w", err)
		}
		if order, err = load(tx, row); err != nil {
			return err
		}
		if changed = order.Cancel(cmd, time.Now()); !changed {
			return nil
		}
		if err := tx.Model(&orderRow{}).Where("id = ?", id).Updates(map[string]any{
			"status": order.Status, "cancelled_at": order.CancelledAt, "cancel_reason": order.CancelReason,
		}).Error; err != nil {
			return fmt.Errorf("cancel order: %w", err)
		}
		msg, err := events.OrderCancelledEvent.Message(order.CancelledEvent())
		if err != nil {
			return err
		}
		msg.OccurredAt, msg.CorrelationID = *order.CancelledAt, order.ID.String()
		return messaging.Enqueue(ctx, s.driver, tx, msg)
	}, readCommitted)
	if err != nil {
		return Order{}, false, err
	}
	return order, changed, nil
}

// Get returns an order with its lines.
func (s *Store) Get(ctx context.Context, id uuid.UUID) (Order, error) {
	db := s.db.WithContext(ctx)
	var row orderRow
	if err := db.Take(&row, "id = ?", id).Error; err != nil {
		if errors.Is(err, gorm.ErrRecordNotFound) {
			return Order{}, ErrNotFound
		}
		return Order{}, fmt.Errorf("load order: %w", err)
	}
	return load(db, row)
}

func load(db *gorm.DB, row orderRow) (Order, error) {
	var lines []lineRow
	if err := db.Where("order_id = ?", row.ID).Order("line_no").Find(&lines).Error; err != nil {
		return Order{}, fmt.Errorf("load order lines: %w", err)
	}
	o := Order{ID: row.ID, CustomerID: row.CustomerID, TotalCents: row.TotalCents, Status: row.Status,
		CreatedAt: row.CreatedAt.UTC(), Lines: make([]Line, len(lines))}
	if row.CancelledAt != nil {
		at := row.CancelledAt.UTC()
		o.CancelledAt = &at
	}
	if row.CancelReason != nil {
		o.CancelReason = *row.CancelReason
	}
	for i, l := range lines {
		o.Lines[i] = Line{SKU: l.SKU, Quantity: l.Quantity, UnitPriceCents: l.UnitPriceCents}
	}
	return o, nil
}

// commandHash identifies a command's content, whatever the client's JSON spacing or key order.
// It hashes the command as Go encodes it: a field added to PlaceOrder or Line must be omitted
// when unset (omitempty, or omitzero for a struct), and the fields there are keep their names
// and order, or a request sent before the deploy and retried after it, with its
// Idempotency-Key, hashes otherwise and is refused as another body.
func commandHash(cmd PlaceOrder) (string, error) {
	b, err := json.Marshal(cmd)
	if err != nil {
		return "", fmt.Errorf("hash command: %w", err)
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:]), nil
}
