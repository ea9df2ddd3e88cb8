// Package gormdriver adapts a GORM handle on PostgreSQL to the messaging library: handlers get
// their message's transaction as a *gorm.DB, and messaging.Enqueue writes into the caller's
// (the tx of db.Transaction). The library's own statements go to GORM's database/sql
// connection pool directly, without GORM's reflection. With GORM's postgres driver (pgx
// underneath), a relay on it wakes at each commit of an Enqueue (LISTEN/NOTIFY).
package gormdriver

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/jackc/pgx/v5/stdlib"
	"gorm.io/gorm"

	"github.com/outboxkit/outbox-inbox/pkg/messaging"
	"github.com/outboxkit/outbox-inbox/pkg/messaging/sqldriver"
)

// Driver is the GORM adapter.
type Driver struct {
	db  *gorm.DB
	sql *sqldriver.Driver
}

// New returns the adapter of db, whose connection pool must be database/sql's (GORM's default).
func New(db *gorm.DB) (*Driver, error) {
	sqlDB, err := db.DB()
	if err != nil {
		return nil, fmt.Errorf("gormdriver: the connection pool behind GORM: %w", err)
	}
	return &Driver{db: db, sql: sqldriver.New(sqlDB).WithNotifications(waitPgx)}, nil
}

// DB returns GORM's connection pool.
func (d *Driver) DB() messaging.DB { return d.sql.DB() }

// Executor runs statements in tx, which must be inside a transaction (the tx of
// db.Transaction): given a plain *gorm.DB, Enqueue would commit the messages on their own and
// bring back the dual write, so it is refused with messaging.ErrNotInTransaction.
func (d *Driver) Executor(tx *gorm.DB) (messaging.Executor, error) {
	if tx == nil {
		return nil, messaging.ErrNotInTransaction
	}
	if _, ok := tx.Statement.ConnPool.(gorm.TxCommitter); !ok {
		return nil, messaging.ErrNotInTransaction
	}
	q, ok := tx.Statement.ConnPool.(sqldriver.Queryer)
	if !ok {
		return nil, fmt.Errorf("gormdriver: GORM's connection pool %T does not run database/sql statements", tx.Statement.ConnPool)
	}
	return sqldriver.Executor(q), nil
}

// Begin opens a READ COMMITTED transaction whose statements run under ctx. It commits and
// rolls back as sqldriver's do, GORM's own Commit and Rollback calling the same methods of
// database/sql's transaction underneath.
func (d *Driver) Begin(ctx context.Context) (*gorm.DB, messaging.TxExecutor, error) {
	ctx, end := context.WithCancel(ctx)
	tx := d.db.WithContext(ctx).Begin(&sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if tx.Error != nil {
		end()
		return nil, nil, tx.Error
	}
	sqlTx, ok := tx.Statement.ConnPool.(sqldriver.Transaction)
	if !ok {
		tx.Rollback()
		end()
		return nil, nil, fmt.Errorf("gormdriver: GORM's transaction %T does not run database/sql statements", tx.Statement.ConnPool)
	}
	return tx, sqldriver.TxWithEnd(sqlTx, end), nil
}

// waitPgx receives a notification through pgx, the driver under GORM's postgres dialector.
func waitPgx(ctx context.Context, c *sql.Conn) error {
	return c.Raw(func(driverConn any) error {
		sc, ok := driverConn.(*stdlib.Conn)
		if !ok {
			return fmt.Errorf("%w: the connection is a %T, not pgx's", messaging.ErrNoNotifications, driverConn)
		}
		_, err := sc.Conn().WaitForNotification(ctx)
		return err
	})
}
