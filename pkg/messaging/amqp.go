package messaging

import (
	"encoding/json"
	"errors"
	"fmt"
	"mime"
	"time"

	"github.com/google/uuid"
	amqp "github.com/rabbitmq/amqp091-go"
)

const (
	contentTypeJSON     = "application/json"
	correlationIDHeader = "correlation_id"
	defaultHeartbeat    = 10 * time.Second
	dialTimeout         = 10 * time.Second
)

// dial opens a connection with heartbeats (so a half-open TCP connection is noticed in
// bounded time) and a connection name that shows up in the broker's management tools.
func dial(url, name string, heartbeat time.Duration) (*amqp.Connection, error) {
	if heartbeat <= 0 {
		heartbeat = defaultHeartbeat
	}
	props := amqp.NewConnectionProperties()
	props.SetClientConnectionName(name)
	conn, err := amqp.DialConfig(url, amqp.Config{
		Heartbeat:  heartbeat,
		Locale:     "en_US",
		Properties: props,
		Dial:       amqp.DefaultDial(dialTimeout),
	})
	if err != nil {
		return nil, fmt.Errorf("dial rabbitmq: %w", err)
	}
	return conn, nil
}

// toPublishing puts the envelope into AMQP properties, so consumers (and people reading a
// queue in the management UI) see id, type and time without parsing the body.
func toPublishing(m Message, appID string) amqp.Publishing {
	p := amqp.Publishing{
		ContentType:  contentTypeJSON,
		DeliveryMode: amqp.Persistent,
		MessageId:    m.ID.String(),
		Type:         m.Type,
		Timestamp:    m.OccurredAt,
		AppId:        appID,
		Body:         m.Payload,
	}
	if m.CorrelationID != "" {
		p.CorrelationId = m.CorrelationID
		p.Headers = amqp.Table{correlationIDHeader: m.CorrelationID}
	}
	return p
}

// fromDelivery reads the envelope back. Its errors are Permanent: a delivery without a valid
// message id or a JSON body will never become handleable, however often it is retried.
func fromDelivery(d amqp.Delivery, maxBody int) (Message, error) {
	id, err := uuid.Parse(d.MessageId)
	if err != nil {
		return Message{}, Permanent(fmt.Errorf("invalid message_id %q: %w", truncate(d.MessageId, 64), err))
	}
	if d.ContentType != "" {
		mt, _, err := mime.ParseMediaType(d.ContentType)
		if err != nil || mt != contentTypeJSON {
			return Message{}, Permanent(fmt.Errorf("content type %q is not %s", truncate(d.ContentType, 64), contentTypeJSON))
		}
	}
	if maxBody > 0 && len(d.Body) > maxBody {
		return Message{}, Permanent(fmt.Errorf("body of %d bytes exceeds the limit of %d", len(d.Body), maxBody))
	}
	if !json.Valid(d.Body) {
		return Message{}, Permanent(errors.New("body is not valid JSON"))
	}
	corr := d.CorrelationId
	if v, ok := d.Headers[correlationIDHeader].(string); ok && corr == "" {
		corr = v
	}
	return Message{ID: id, Type: d.Type, Payload: d.Body, OccurredAt: d.Timestamp, CorrelationID: corr}, nil
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}
