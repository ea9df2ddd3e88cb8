package main

import (
	"context"
	"fmt"
	"io"
	"net/url"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"
	"gorm.io/driver/postgres"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/outboxkit/outbox-inbox/internal/platform"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// latestErrors is how many failing rows status shows.
const latestErrors = 10

// dbTimeout bounds each command's work in the database: an operator waiting on a database that
// does not answer learns it, instead of waiting forever.
const dbTimeout = 30 * time.Second

// status prints the state of the outbox: what alerts on it are about.
func status(ctx context.Context, args []string, stdout io.Writer) error {
	fs := newFlags("status")
	dbFlag := fs.String("db", "", "")
	if _, err := parse(fs, args); err != nil {
		return err
	}
	dbURL, db, err := openDB(ctx, *dbFlag)
	if err != nil {
		return err
	}
	defer platform.CloseDB(db)
	ctx, cancel := context.WithTimeout(ctx, dbTimeout)
	defer cancel()
	stats, err := messaging.ReadOutboxStats(ctx, db)
	if err != nil {
		return err
	}
	failing, err := messaging.FailingOutboxMessages(ctx, db, latestErrors)
	if err != nil {
		return err
	}

	fmt.Fprintf(stdout, "outbox in %s\n", platform.Redact(dbURL))
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	oldest := "none"
	if stats.Pending > 0 {
		oldest = stats.OldestPending.Round(time.Second).String()
	}
	fmt.Fprintf(tw, "unsent rows:\t%d\n", stats.Pending)
	fmt.Fprintf(tw, "oldest unsent row:\t%s\n", oldest)
	fmt.Fprintf(tw, "highest attempt count:\t%d\n", stats.MaxAttempts)
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(failing) == 0 {
		fmt.Fprintln(stdout, "no unsent row has failed")
		return nil
	}
	fmt.Fprintf(stdout, "\nlatest errors (%d unsent rows that failed, latest next attempt first):\n", len(failing))
	tw = tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "MESSAGE ID\tTYPE\tATTEMPTS\tNEXT ATTEMPT\tLAST ERROR")
	now := time.Now()
	for _, m := range failing {
		lastError := ""
		if m.LastError != nil {
			lastError = *m.LastError
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\n", m.ID, printable(m.Type, 64), m.Attempts, nextAttempt(m.NextAttemptAt, now), printable(lastError, 200))
	}
	return tw.Flush()
}

// nextAttempt says when a row is tried next, in UTC and from now.
func nextAttempt(at, now time.Time) string {
	when := at.UTC().Format(time.RFC3339)
	if wait := at.Sub(now); wait > 0 {
		return fmt.Sprintf("%s (in %s)", when, wait.Round(time.Second))
	}
	return when + " (due)"
}

// retry makes failed rows due now, all of them or the one --id names.
func retry(ctx context.Context, args []string, stdout io.Writer) error {
	fs := newFlags("retry")
	dbFlag := fs.String("db", "", "")
	idFlag := fs.String("id", "", "")
	if _, err := parse(fs, args); err != nil {
		return err
	}
	var id uuid.UUID
	if *idFlag != "" {
		var err error
		if id, err = uuid.Parse(*idFlag); err != nil {
			return usageError{fmt.Sprintf("--id %q is not a UUID", printable(*idFlag, 64))}
		}
	}
	_, db, err := openDB(ctx, *dbFlag)
	if err != nil {
		return err
	}
	defer platform.CloseDB(db)
	ctx, cancel := context.WithTimeout(ctx, dbTimeout)
	defer cancel()
	if id != uuid.Nil {
		if err := messaging.RetryOutboxMessage(ctx, db, id); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "outbox row %s is due now; the relay sends it next\n", id)
		return nil
	}
	n, err := messaging.RetryOutboxMessages(ctx, db)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "%d failed outbox rows were waiting for their next attempt; they are due now\n", n)
	return nil
}

// openDB connects to the database --db or DATABASE_URL names, and returns its URL too.
func openDB(ctx context.Context, flagValue string) (string, *gorm.DB, error) {
	rawURL, err := urlFrom("db", flagValue, "DATABASE_URL", "postgres", "postgresql")
	if err != nil {
		return "", nil, err
	}
	dsn, err := url.Parse(rawURL)
	if err != nil {
		return "", nil, err
	}
	q := dsn.Query()
	if q.Get("application_name") == "" {
		q.Set("application_name", "outboxctl") // how its sessions show in pg_stat_activity
	}
	dsn.RawQuery = q.Encode()
	db, err := gorm.Open(postgres.Open(dsn.String()), &gorm.Config{Logger: logger.Discard, DisableAutomaticPing: true})
	if err != nil {
		return "", nil, fmt.Errorf("open database: %w", err)
	}
	sqlDB, err := db.DB()
	if err != nil {
		return "", nil, fmt.Errorf("open database: %w", err)
	}
	sqlDB.SetMaxOpenConns(2)
	pingCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := sqlDB.PingContext(pingCtx); err != nil {
		_ = sqlDB.Close()
		return "", nil, fmt.Errorf("connect to the database: %w", err)
	}
	return rawURL, db, nil
}
