package deploy_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outboxkit/outbox-inbox/internal/events"
	"github.com/outboxkit/outbox-inbox/internal/testenv"
	"github.com/outboxkit/outbox-inbox/pkg/messaging"
)

// brokerRole is what one service does on the broker besides declaring events.Topology at
// start: the exchange its relay publishes to, and the queue it consumes.
type brokerRole struct {
	publishes string // exchange; "" if the service has no outbox
	consumes  string // queue; "" if the service consumes nothing
}

// brokerRoles: each publishing service owns the exchange its events go to (events.Exchange is
// the order service's), and each consumer's queue is named after it.
var brokerRoles = map[string]brokerRole{
	"order":        {publishes: events.Exchange},
	"invoicing":    {publishes: events.InvoicingExchange, consumes: events.InvoicingQueue},
	"notification": {consumes: events.NotificationQueue},
}

// Every service has a role, and every exchange and queue of events.Topology has exactly one
// owner among them: a new one needs a decision on who may do what with it.
func TestBrokerRolesCoverTheTopology(t *testing.T) {
	t.Parallel()
	for _, a := range apps {
		if _, ok := brokerRoles[a.name]; !ok {
			t.Errorf("service %s has no broker role", a.name)
		}
	}
	owners := func(name string, of func(brokerRole) string) []string {
		var who []string
		for svc, r := range brokerRoles {
			if of(r) == name {
				who = append(who, svc)
			}
		}
		return who
	}
	for _, x := range events.Topology.AllExchanges() {
		if who := owners(x, func(r brokerRole) string { return r.publishes }); len(who) != 1 {
			t.Errorf("exchange %s is published to by %v, want exactly one service", x, who)
		}
	}
	for _, q := range events.Topology.Queues {
		if who := owners(q.Queue, func(r brokerRole) string { return r.consumes }); len(who) != 1 {
			t.Errorf("queue %s is consumed by %v, want exactly one service", q.Queue, who)
		}
	}
	for svc, r := range brokerRoles {
		if r.publishes != "" && !slices.Contains(events.Topology.AllExchanges(), r.publishes) {
			t.Errorf("%s publishes to %s, which is not in events.Topology", svc, r.publishes)
		}
		if _, ok := events.Topology.Queue(r.consumes); r.consumes != "" && !ok {
			t.Errorf("%s consumes %s, which is not in events.Topology", svc, r.consumes)
		}
	}
}

// TestBrokerPermissions imports deploy/rabbitmq/definitions.json, exactly as written, into a
// fresh virtual host of the local broker (its users as users of their own, with test
// passwords), as the compose broker does at boot: the topology, the users and their
// permissions. There, each service does what its binary does at start, declaring the whole
// of events.Topology (the refusals for what it may not configure are accepted, since the
// definitions declared it), then its work: publishing, consuming, dead-lettering. And each is
// refused what belongs to another.
func TestBrokerPermissions(t *testing.T) {
	t.Parallel()
	defs := readDefinitions(t)
	// Beside the file's users, invoicing without write on amq.default: the right its own
	// dead-lettering needs, shown by its absence.
	inv, ok := defs.user("invoicing")
	perm, _ := defs.permissions("invoicing", "/")
	noDLX := perm
	noDLX.User, noDLX.Write = "invoicing-without-amq.default", strings.Replace(perm.Write, `|amq\.default`, "", 1)
	if !ok || noDLX.Write == perm.Write {
		t.Fatalf("%s: invoicing's write permission %q does not name amq.default as this test expects", definitionsFile, perm.Write)
	}
	inv.Name = noDLX.User
	defs.Users, defs.Permissions = append(defs.Users, inv), append(defs.Permissions, noDLX)
	users, vhost := importForTest(t, defs)
	// The broker holds the whole topology once it imported the definitions, before any
	// service has connected.
	held := topologyDiff{want: systemTopology(t).withoutArguments()}
	testenv.Eventually(t, time.Minute, func() bool {
		held.got = brokerHolds(t, vhost)
		return held.want.diff(held.got) == nil
	}, "after importing %s, the broker's topology differs from events.Topology:\n%v", definitionsFile, &held)
	order, invoicing, notification, outboxctl := users["order"], users["invoicing"], users["notification"], users["outboxctl"]
	for _, u := range []*brokerUser{order, invoicing, notification, outboxctl} {
		if u == nil {
			t.Fatalf("%s lacks one of the users order, invoicing, notification and outboxctl", definitionsFile)
		}
	}
	orders, invoices := brokerRoles["order"].publishes, brokerRoles["invoicing"].publishes
	invoicingQueue, notificationQueue := brokerRoles["invoicing"].consumes, brokerRoles["notification"].consumes
	invoicingTopology, _ := events.Topology.Queue(invoicingQueue)
	notificationTopology, _ := events.Topology.Queue(notificationQueue)
	invoicingDLQ, notificationDLQ := messaging.DeadLetterQueue(invoicingQueue), messaging.DeadLetterQueue(notificationQueue)

	// At start, every service declares the whole topology, with its own user's rights.
	for _, a := range apps {
		users[a.name].mustDeclareTopology()
	}
	users[noDLX.User].mustDeclareTopology()

	// What those declarations could not have done: take, change or remove another's
	// resources. (A refused declaration of an existing resource changes nothing.)
	order.refused("declare the queue "+invoicingQueue, declareQueue(invoicingTopology))
	order.refused("declare the exchange "+invoices, declareExchange(invoices))
	order.refused("delete the queue "+invoicingQueue, deleteQueue(invoicingQueue))
	order.refused("bind the queue "+invoicingQueue+" to "+orders+" with #", bind(invoicingQueue, orders, "#"))
	invoicing.refused("declare the queue "+notificationQueue, declareQueue(notificationTopology))
	invoicing.refused("delete the queue "+notificationQueue, deleteQueue(notificationQueue))
	invoicing.refused("bind the queue "+notificationQueue+" to "+invoices+" with #", bind(notificationQueue, invoices, "#"))
	notification.refused("delete the queue "+invoicingDLQ, deleteQueue(invoicingDLQ))
	notification.refused("bind the queue "+invoicingQueue+" to "+orders+" with #", bind(invoicingQueue, orders, "#"))
	outboxctl.refused("declare a queue", declareQueue(messaging.ConsumerTopology{Queue: "outboxctl_scratch"}))
	outboxctl.refused("delete the queue "+invoicingDLQ, deleteQueue(invoicingDLQ))

	// Publishing: each relay to its own exchange, routed to the queues bound to it.
	order.mustAllow("publish OrderPlaced to "+orders, publish(orders, events.OrderPlacedType))
	invoicing.mustAllow("publish InvoiceIssued to "+invoices, publish(invoices, events.InvoiceIssuedType))
	order.refused("publish to "+invoices, publish(invoices, events.InvoiceIssuedType))
	invoicing.refused("publish to "+orders, publish(orders, events.OrderPlacedType))
	notification.refused("publish to "+orders, publish(orders, events.OrderPlacedType))
	notification.refused("publish to "+invoices, publish(invoices, events.InvoiceIssuedType))
	outboxctl.refused("publish to "+orders, publish(orders, events.OrderPlacedType))

	// Consuming: each its own queue only.
	order.refused("consume from "+invoicingQueue, consume(invoicingQueue))
	invoicing.refused("consume from "+notificationQueue, consume(notificationQueue))
	notification.refused("consume from "+invoicingDLQ, consume(invoicingDLQ))

	// Dead-lettering: invoicing rejects the OrderPlaced it got, and the broker moves it to its
	// dead-letter queue (the queue's own arguments, no permission asked); outboxctl takes it
	// from there and puts it back on the queue through the default exchange.
	invoicing.mustAllow("consume from "+invoicingQueue+" and reject a message", func(ch *amqp.Channel) error {
		d, err := next(ch, invoicingQueue)
		if err != nil {
			return err
		}
		if d.Type != events.OrderPlacedType {
			return fmt.Errorf("got a %q, want the OrderPlaced published above", d.Type)
		}
		return d.Reject(false)
	})
	outboxctl.mustAllow("read the depth of "+invoicingDLQ, func(ch *amqp.Channel) error {
		_, err := ch.QueueDeclarePassive(invoicingDLQ, true, false, false, false, nil)
		return err
	})
	outboxctl.mustAllow("move the dead-lettered message from "+invoicingDLQ+" back to "+invoicingQueue, func(ch *amqp.Channel) error {
		d, err := poll(ch, invoicingDLQ)
		if err != nil {
			return err
		}
		if err := publishOn(ch, "", invoicingQueue, d.Type); err != nil {
			return err
		}
		return d.Ack(false)
	})
	invoicing.mustAllow("consume the moved message from "+invoicingQueue, takeOne(invoicingQueue, events.OrderPlacedType))
	// The consumer dead-letters a message itself, with its reason, through the default
	// exchange: that needs write on amq.default.
	invoicing.mustAllow("publish to its dead-letter queue through the default exchange", publish("", invoicingDLQ))
	users[noDLX.User].refused("publish to its dead-letter queue through the default exchange", publish("", invoicingDLQ))
	// outboxctl in the service's container logs in with the service's AMQP_URL: its user
	// lists and redrives its own dead letters, and may not read another consumer's.
	invoicing.mustAllow("list and redrive "+invoicingDLQ+", as outboxctl dlq does in its container", redriveOwn(invoicing.url, invoicingQueue, invoicingDLQ))
	invoicing.mustAllow("consume the redriven message from "+invoicingQueue, takeOne(invoicingQueue, invoicingDLQ))
	invoicing.refused("get from "+notificationDLQ, get(notificationDLQ))
	notification.refused("get from "+invoicingDLQ, get(invoicingDLQ))
	notification.mustAllow("consume OrderPlaced and InvoiceIssued from "+notificationQueue, func(ch *amqp.Channel) error {
		got := map[string]bool{}
		deliveries, err := ch.Consume(notificationQueue, "", false, false, false, false, nil)
		if err != nil {
			return err
		}
		timeout := time.After(15 * time.Second)
		for len(got) < 2 {
			select {
			case d := <-deliveries:
				got[d.Type] = true
				if err := d.Ack(false); err != nil {
					return err
				}
			case <-timeout:
				return fmt.Errorf("got %v within 15 s, want OrderPlaced and InvoiceIssued", got)
			}
		}
		return nil
	})

	notification.mustAllow("publish to its dead-letter queue through the default exchange", publish("", notificationDLQ))
	notification.mustAllow("list and redrive "+notificationDLQ+", as outboxctl dlq does in its container", redriveOwn(notification.url, notificationQueue, notificationDLQ))
	notification.mustAllow("consume the redriven message from "+notificationQueue, takeOne(notificationQueue, notificationDLQ))

	// What the file allows beyond each service's needs, because RabbitMQ's permissions are
	// regular expressions over names and cannot tell a queue from an exchange, and because
	// the default exchange reaches every queue. These pass today; if one fails, the permissions
	// got tighter: update docs/deployment.md too, which lists what they still allow.
	notification.mustAllow("read the queue "+invoicingQueue+" (the name of an exchange it binds from)", func(ch *amqp.Channel) error {
		_, _, err := ch.Get(invoicingQueue, false)
		return err
	})
	notification.mustAllow("publish to any queue through the default exchange (its dead-lettering needs write on it)", publish("", invoicingQueue))
	// Last, as it removes the exchange: configure on orders, which lets invoicing declare the
	// exchange it binds from, lets it delete it too.
	invoicing.mustAllow("delete the exchange "+orders+" (configure on it lets it declare the exchange it binds from)", deleteExchange(orders))
}

// Each consumer's user may read its own dead-letter queue, so that outboxctl dlq, run in the
// service's container with its AMQP_URL, lists and redrives it; and no other consumer's, nor
// may a service that consumes nothing read any. TestBrokerPermissions shows it on a broker.
func TestServiceUsersReadTheirOwnDeadLetterQueueOnly(t *testing.T) {
	t.Parallel()
	defs := readDefinitions(t)
	for svc := range brokerRoles {
		perm, ok := defs.permissions(svc, "/")
		if !ok {
			t.Errorf("%s gives %s no permissions on the virtual host /", definitionsFile, svc)
			continue
		}
		read, err := regexp.Compile(perm.Read)
		if err != nil {
			t.Errorf("%s: %s's read permission %q: %v", definitionsFile, svc, perm.Read, err)
			continue
		}
		for owner, r := range brokerRoles {
			if r.consumes == "" {
				continue
			}
			dlq := messaging.DeadLetterQueue(r.consumes)
			if got, want := read.MatchString(dlq), owner == svc; got != want {
				t.Errorf("%s: %s's read permission %q reads %s (of %s): %v, want %v", definitionsFile, svc, perm.Read, dlq, owner, got, want)
			}
		}
	}
}

// brokerUser is one user of the test's virtual host, connected.
type brokerUser struct {
	t    *testing.T
	name string // as in the definitions file
	url  string // its AMQP URL, to the test's virtual host
	conn *amqp.Connection
}

// do runs op on a new channel: a refusal closes the channel, not the connection.
func (u *brokerUser) do(op func(ch *amqp.Channel) error) error {
	ch, err := u.conn.Channel()
	if err != nil {
		u.t.Fatalf("%s: open a channel: %v", u.name, err)
	}
	defer func() { _ = ch.Close() }()
	return op(ch)
}

func (u *brokerUser) mustAllow(what string, op func(ch *amqp.Channel) error) {
	u.t.Helper()
	if err := u.do(op); err != nil {
		u.t.Fatalf("%s may %s, but: %v", u.name, what, err)
	}
}

func (u *brokerUser) refused(what string, op func(ch *amqp.Channel) error) {
	u.t.Helper()
	err := u.do(op)
	var aerr *amqp.Error
	if !errors.As(err, &aerr) || aerr.Code != amqp.AccessRefused {
		u.t.Errorf("%s may not %s, want 403 ACCESS_REFUSED, got: %v", u.name, what, err)
	}
}

// mustDeclareTopology declares events.Topology as the service's binary does at start, on a
// connection of its own: the declarations its user may not make are refused, and accepted as
// the deployment's. Its log says which, in the test's output.
func (u *brokerUser) mustDeclareTopology() {
	u.t.Helper()
	conn, err := amqp.Dial(u.url)
	if err != nil {
		u.t.Fatalf("%s: connect: %v", u.name, err)
	}
	defer func() { _ = conn.Close() }()
	var log bytes.Buffer
	err = events.Topology.Declare(conn, slog.New(slog.NewTextHandler(&log, &slog.HandlerOptions{Level: slog.LevelDebug})))
	u.t.Logf("%s declared events.Topology:\n%s", u.name, log.String())
	if err != nil {
		u.t.Fatalf("%s cannot declare events.Topology at start, as its binary does: %v", u.name, err)
	}
}

func declareExchange(name string) func(*amqp.Channel) error {
	return func(ch *amqp.Channel) error {
		return ch.ExchangeDeclare(name, amqp.ExchangeTopic, true, false, false, false, nil)
	}
}

func deleteExchange(name string) func(*amqp.Channel) error {
	return func(ch *amqp.Channel) error { return ch.ExchangeDelete(name, false, false) }
}

// declareQueue declares q's queue with its arguments, as its consumer does.
func declareQueue(q messaging.ConsumerTopology) func(*amqp.Channel) error {
	return func(ch *amqp.Channel) error {
		_, err := ch.QueueDeclare(q.Queue, true, false, false, false, q.Arguments())
		return err
	}
}

func deleteQueue(name string) func(*amqp.Channel) error {
	return func(ch *amqp.Channel) error {
		_, err := ch.QueueDelete(name, false, false, false)
		return err
	}
}

func bind(queue, exchange, key string) func(*amqp.Channel) error {
	return func(ch *amqp.Channel) error { return ch.QueueBind(queue, key, exchange, false, nil) }
}

func consume(queue string) func(*amqp.Channel) error {
	return func(ch *amqp.Channel) error {
		_, err := ch.Consume(queue, "", false, false, false, false, nil)
		return err
	}
}

// publish publishes one message to exchange with routing key key, typed key too (the
// services' routing key is the event type).
func publish(exchange, key string) func(*amqp.Channel) error {
	return func(ch *amqp.Channel) error { return publishOn(ch, exchange, key, key) }
}

// publishOn publishes one persistent, mandatory message and waits for the broker's verdict:
// nil once it is confirmed and routed; the broker's error when it closed the channel instead
// (a refusal); an error when it was returned unroutable.
func publishOn(ch *amqp.Channel, exchange, key, msgType string) error {
	if err := ch.Confirm(false); err != nil {
		return err
	}
	closed := ch.NotifyClose(make(chan *amqp.Error, 1))
	returned := ch.NotifyReturn(make(chan amqp.Return, 1))
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, exchange, key, true, false, amqp.Publishing{
		DeliveryMode: amqp.Persistent, Type: msgType, MessageId: testenv.UniqueName("msg"),
		ContentType: "application/json", Body: []byte(`{}`),
	})
	if err != nil {
		return err
	}
	acked, err := dc.WaitContext(ctx)
	switch {
	case err != nil:
		return fmt.Errorf("no confirm within 15 s: %w", err)
	case acked:
		select {
		case r := <-returned:
			return fmt.Errorf("returned unroutable: %s", r.ReplyText)
		default:
			return nil
		}
	}
	select {
	case e := <-closed:
		if e != nil {
			return e
		}
		return errors.New("the channel closed without a reason")
	case <-ctx.Done():
		return errors.New("nacked, and the channel stays open")
	}
}

// takeOne consumes the next message of queue, wants it of type typ, and acknowledges it.
func takeOne(queue, typ string) func(*amqp.Channel) error {
	return func(ch *amqp.Channel) error {
		d, err := next(ch, queue)
		if err != nil {
			return err
		}
		if d.Type != typ {
			return fmt.Errorf("got a %q, want the %s", d.Type, typ)
		}
		return d.Ack(false)
	}
}

func get(queue string) func(*amqp.Channel) error {
	return func(ch *amqp.Channel) error {
		_, _, err := ch.Get(queue, false)
		return err
	}
}

// redriveOwn lists the dead-letter queue dlq of queue and moves what waits there back to
// queue, logged in at url, as outboxctl dlq list and dlq redrive do: on a connection of their
// own, with a passive declaration of each queue, basic.get, basic.nack, a confirmed publish
// through the default exchange and basic.ack. It wants the one message published to dlq under
// its own name, trying for up to 15 s to see it listed.
func redriveOwn(url, queue, dlq string) func(*amqp.Channel) error {
	return func(*amqp.Channel) error {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		cfg := messaging.DeadLetterConfig{URL: url, Queue: queue}
		deadline := time.Now().Add(15 * time.Second)
		for {
			listed, _, err := messaging.ListDeadLetters(ctx, cfg, 0)
			if err != nil {
				return fmt.Errorf("list: %w", err)
			}
			if len(listed) == 1 && listed[0].Type == dlq {
				break
			}
			if len(listed) > 1 || time.Now().After(deadline) {
				return fmt.Errorf("listed %d messages of %s, want the one of type %s", len(listed), dlq, dlq)
			}
			time.Sleep(50 * time.Millisecond)
		}
		moved, err := messaging.RedriveDeadLetters(ctx, cfg, messaging.DeadLetterSelection{})
		if err != nil {
			return fmt.Errorf("redrive: %w", err)
		}
		if len(moved) != 1 {
			return fmt.Errorf("moved %d messages from %s, want 1", len(moved), dlq)
		}
		return nil
	}
}

// next consumes the first delivery of queue, waiting up to 15 s for it.
func next(ch *amqp.Channel, queue string) (amqp.Delivery, error) {
	if err := ch.Qos(1, 0, false); err != nil {
		return amqp.Delivery{}, err
	}
	deliveries, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		return amqp.Delivery{}, err
	}
	select {
	case d, ok := <-deliveries:
		if !ok {
			return amqp.Delivery{}, errors.New("the consumer was cancelled")
		}
		return d, nil
	case <-time.After(15 * time.Second):
		return amqp.Delivery{}, fmt.Errorf("no message in %s within 15 s", queue)
	}
}

// poll gets one message of queue with basic.get, as an operator's tool would, trying until
// one is there or 15 s have passed (dead-lettering is asynchronous).
func poll(ch *amqp.Channel, queue string) (amqp.Delivery, error) {
	deadline := time.Now().Add(15 * time.Second)
	for {
		d, ok, err := ch.Get(queue, false)
		if err != nil || ok {
			return d, err
		}
		if time.Now().After(deadline) {
			return amqp.Delivery{}, fmt.Errorf("no message in %s within 15 s", queue)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// brokerHolds is the topology the broker holds in vhost, as rabbitmqctl lists it: every
// exchange but the built-in ones, every queue, every binding but the default exchange's,
// without their x-arguments, the queue type among them (rabbitmqctl formats those differently
// across versions; the owners' own declarations check them, as the broker refuses other ones).
// The vhost reads as /, the one the test's stands for.
func brokerHolds(t *testing.T, vhost string) *brokerTopology {
	t.Helper()
	b := newBrokerTopology()
	for _, x := range listBroker(t, "list_exchanges", vhost, "name", "type", "durable", "auto_delete", "internal") {
		name, _ := x["name"].(string)
		if name == "" || strings.HasPrefix(name, "amq.") {
			continue
		}
		typ, _ := x["type"].(string)
		b.exchange(name, exchangeDecl{VHost: "/", Type: typ, Durable: x["durable"] == true, AutoDelete: x["auto_delete"] == true, Internal: x["internal"] == true})
	}
	for _, q := range listBroker(t, "list_queues", vhost, "name", "durable", "auto_delete") {
		name, _ := q["name"].(string)
		b.queue(name, queueDecl{VHost: "/", Durable: q["durable"] == true, AutoDelete: q["auto_delete"] == true})
	}
	for _, bind := range listBroker(t, "list_bindings", vhost, "source_name", "destination_name", "destination_kind", "routing_key") {
		source, _ := bind["source_name"].(string)
		if source == "" {
			continue
		}
		dest, _ := bind["destination_name"].(string)
		kind, _ := bind["destination_kind"].(string)
		key, _ := bind["routing_key"].(string)
		b.binding(bindingDecl{VHost: "/", Source: source, Destination: dest, DestinationType: kind, RoutingKey: key})
	}
	return b
}

// listBroker runs one of rabbitmqctl's list commands on vhost and returns its rows.
func listBroker(t *testing.T, command, vhost string, columns ...string) []map[string]any {
	t.Helper()
	args := append([]string{"-q", command, "-p", vhost}, columns...)
	out, err := testenv.RabbitMQCtlCommand(append(args, "--formatter", "json")...).Output()
	if err != nil {
		t.Fatalf("rabbitmqctl %s: %v", strings.Join(args, " "), err)
	}
	var rows []map[string]any
	if err := json.Unmarshal(out, &rows); err != nil {
		t.Fatalf("rabbitmqctl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return rows
}

// importForTest imports defs into the local broker with every name made the test's own: the
// virtual host / becomes a fresh one, each user NAME becomes NAME_<suffix> with a random
// password, and the topology and permissions stay as written. It returns the users,
// connected, and the virtual host; the virtual host, with all it holds, and the users are
// deleted when the test ends.
func importForTest(t *testing.T, defs definitions) (map[string]*brokerUser, string) {
	t.Helper()
	vhost := testenv.UniqueName("perms")
	suffix := strings.TrimPrefix(vhost, "perms_")
	test := definitions{VHosts: []defVHost{{Name: vhost}}}
	inVHost := func(what, name, v string) {
		if v != "/" {
			t.Fatalf("%s: %s %s is in virtual host %q; this test maps the virtual host / only", definitionsFile, what, name, v)
		}
	}
	for _, x := range defs.Exchanges {
		inVHost("exchange", x.Name, x.VHost)
		x.VHost = vhost
		test.Exchanges = append(test.Exchanges, x)
	}
	for _, q := range defs.Queues {
		inVHost("queue", q.Name, q.VHost)
		q.VHost = vhost
		test.Queues = append(test.Queues, q)
	}
	for _, b := range defs.Bindings {
		inVHost("binding to", b.Destination, b.VHost)
		b.VHost = vhost
		test.Bindings = append(test.Bindings, b)
	}
	passwords := map[string]string{}
	for _, u := range defs.Users {
		passwords[u.Name] = testenv.UniqueName("pw")
		test.Users = append(test.Users, defUser{
			Name: u.Name + "_" + suffix, PasswordHash: hashPassword(t, passwords[u.Name]),
			HashingAlgorithm: hashingAlgorithm, Tags: u.Tags,
		})
	}
	for _, p := range defs.Permissions {
		if p.VHost != "/" {
			t.Fatalf("%s: permissions of %s on %q; this test maps the virtual host / only", definitionsFile, p.User, p.VHost)
		}
		p.User, p.VHost = p.User+"_"+suffix, vhost
		test.Permissions = append(test.Permissions, p)
	}
	// Registered first: whatever part of the import happened is removed.
	t.Cleanup(func() {
		for _, args := range append([][]string{{"delete_vhost", vhost}}, usersToDelete(test)...) {
			if out, err := testenv.RabbitMQCtlCommand(append([]string{"-q"}, args...)...).CombinedOutput(); err != nil {
				t.Logf("cleanup: rabbitmqctl %s: %v %s", strings.Join(args, " "), err, out)
			}
		}
	})
	raw, err := json.Marshal(test)
	if err != nil {
		t.Fatal(err)
	}
	if out, err := testenv.RabbitMQImportDefinitions(raw); err != nil {
		t.Fatalf("rabbitmqctl import_definitions (the test's copy of %s): %v\n%s", definitionsFile, err, out)
	}

	base, err := url.Parse(testenv.AMQPURL())
	if err != nil {
		t.Fatal(err)
	}
	users := map[string]*brokerUser{}
	for name, password := range passwords {
		u := *base
		u.User = url.UserPassword(name+"_"+suffix, password)
		u.Path = "/" + vhost
		conn, err := amqp.DialConfig(u.String(), amqp.Config{Properties: amqp.Table{"connection_name": "permissions-test-" + name}})
		if err != nil {
			t.Fatalf("log in as %s (%s's permissions) to the test's virtual host: %v", name, definitionsFile, err)
		}
		t.Cleanup(func() { _ = conn.Close() })
		users[name] = &brokerUser{t: t, name: name, url: u.String(), conn: conn}
	}
	return users, vhost
}

func usersToDelete(d definitions) [][]string {
	var args [][]string
	for _, u := range d.Users {
		args = append(args, []string{"delete_user", u.Name})
	}
	slices.SortFunc(args, func(a, b []string) int { return strings.Compare(a[1], b[1]) })
	return args
}
